"""``raymoe serve`` on a local Ray cluster listens on loopback only: every listening socket of the server's
process tree (uvicorn, the GCS, raylet, dashboard agent, runtime-env agent, the driver actor and every Ray
worker) is bound to 127.0.0.0/8. The server runs as a fresh process without the test session's environment, as a
user would start it, so that nothing but raymoe itself sets Ray up for loopback."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from raymoe.cluster.bootstrap import free_port

_SESSION_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "GLOO_SOCKET_IFNAME", "RAY_ADDRESS")


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening_sockets(pids: set[int]) -> list[tuple[str, int, str]]:
    """``(ip, port, process name)`` of every TCP socket in LISTEN state owned by ``pids``."""
    out = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.NoSuchProcess:
                continue
            out.append((c.laddr.ip, c.laddr.port, name))
    return out


def process_tree(pid: int) -> set[int]:
    root = psutil.Process(pid)
    return {pid} | {p.pid for p in root.children(recursive=True)}


def test_raymoe_serve_listens_on_loopback_only(tiny_model):
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rml-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in _SESSION_ENV}
    env["RAY_TMPDIR"] = ray_tmp
    cmd = [sys.executable, "-m", "raymoe.cli", "serve", "--model", tiny_model, "--dp", "1", "--port",
           str(port), "--max-total-tokens", "1024", "--log-level", "warning"]
    log_path = os.path.join(ray_tmp, "serve.log")  # a file, not a pipe: nobody reads while it serves
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"raymoe serve exited:\n{open(log_path).read()[-3000:]}"
            assert time.monotonic() < deadline, "raymoe serve did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # the driver actor's start-up line reached this console through Ray's log forwarding
        assert "raymoe start-up: 1 cpu rank (float32) in this process: weights loaded" in open(log_path).read()
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": os.path.basename(tiny_model), "prompt": "def f(x):", "max_tokens": 4})
        assert r.status_code == 200, r.text
        sockets = listening_sockets(process_tree(proc.pid))
        names = {name for _, _, name in sockets}
        assert {"gcs_server", "raylet"} <= names, sockets  # the check sees Ray's own processes
        assert ("127.0.0.1", port) in {(ip, p) for ip, p, _ in sockets}
        public = [s for s in sockets if not _is_loopback(s[0])]
        print(subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout)  # for the record
        assert not public, f"listening beyond loopback: {public}"
    finally:
        stop_process_tree(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def stop_process_tree(proc: subprocess.Popen) -> None:
    """SIGINT the server (it stops its engine and local Ray), then kill whatever of its tree is left."""
    if proc.poll() is not None:
        return
    tree = [psutil.Process(pid) for pid in process_tree(proc.pid) if pid != proc.pid]
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    for p in tree:  # psutil refuses to signal a pid that was reused by another process
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
