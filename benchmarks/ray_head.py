"""A Ray head on loopback for the Serve benchmarks (``serve_rolling_update.py``, ``serve_autoscaling.py``): start
it with token auth and its own temp dir, connect, print the checks, stop it and every process it left behind."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from raymoe.cluster.bootstrap import free_port

ROOT = Path(__file__).resolve().parent.parent
T0 = time.monotonic()


def say(msg: str) -> None:
    """Print ``msg`` with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def head_env(**extra: str) -> dict:
    """Token auth and loopback gloo for this process (``os.environ``) and the environment for ``ray start``: this
    checkout first on ``PYTHONPATH``, this interpreter's ``bin`` first on ``PATH``, plus ``extra``."""
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"})
    env = dict(os.environ, **extra, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


def start_head(work: Path, env: dict, gcs: str, *flags: str) -> subprocess.Popen:
    """``ray start --head --block`` at ``gcs`` (``127.0.0.1:PORT``) with every other port chosen free, its temp dir
    under ``work`` and its log in ``work/head.log``; ``flags`` are added (CPUs, dashboard, autoscaler)."""
    cmd = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs.split(':')[1]}",
           f"--temp-dir={work / 'ray'}", *flags, f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--metrics-export-port={free_port()}", f"--node-manager-port={free_port()}",
           f"--object-manager-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
           "--disable-usage-stats"]
    log = open(work / "head.log", "w")  # noqa: SIM115 - lives as long as the head
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def connect(head: subprocess.Popen, work: Path, gcs: str, **init_kwargs) -> None:
    """``ray.init(address=gcs)`` once the head answers (up to about 60 s).

    Raises:
        SystemExit: ``ray start`` exited, or the head never answered.
    """
    import ray

    for _ in range(60):
        try:
            ray.init(address=gcs, **init_kwargs)
            return
        except Exception:  # noqa: BLE001 - the head is still starting
            if head.poll() is not None:
                raise SystemExit(f"FAILED: ray start exited; see {work / 'head.log'}") from None
            time.sleep(1)
    raise SystemExit(f"FAILED: the head at {gcs} did not answer in 60 s; see {work / 'head.log'}")


def report(checks: dict[str, bool]) -> bool:
    """Print each check and PASS / FAILED, shut Serve and this process's Ray connection down; True when all pass."""
    import ray
    from ray import serve

    for what, ok in checks.items():
        say(("ok   " if ok else "FAIL ") + what)
    passed = all(checks.values())
    say("PASS" if passed else "FAILED")
    try:
        serve.shutdown()
    except Exception:  # noqa: BLE001
        pass
    ray.shutdown()
    return passed


def stop_head(head: subprocess.Popen, work: Path, passed: bool, term_rounds: int = 1) -> None:
    """Stop the head by its pid, then any process still running from its temp dir (fake worker nodes can leave a
    raylet behind) with ``term_rounds`` SIGTERMs and a SIGKILL; delete ``work`` when ``passed``, else keep its logs."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
    for sig in (signal.SIGTERM,) * term_rounds + (signal.SIGKILL,):
        pids = subprocess.run(["pgrep", "-f", "--", str(work)], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass
        time.sleep(3 if pids else 0)
    left = subprocess.run(["pgrep", "-f", "--", str(work)], capture_output=True, text=True).stdout.split()
    say(f"head stopped; processes of {work} left: {len(left)}")
    if passed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        say(f"logs kept in {work}")
