"""``raymoe bench profile-serve``: where a served step's time goes, from py-spy samples of every engine process.

Starts ``raymoe serve`` (given topology) on 127.0.0.1, warms it up, then records py-spy (``--threads``, native
frames off) of the HTTP front end, the driver actor and every rank actor for ``--seconds`` while the
``vllm bench serve`` client of the peers install keeps ``--concurrency`` streams busy.

How much CPU each process spent comes from the kernel, not from the samples: its user + system time
(``/proc/<pid>/stat``) over the window, divided by the engine steps in it (``raymoe:engine_steps_total``). py-spy
only splits that time into categories: a sample is put in one by the deepest frame that names one
(:data:`CATEGORIES`; samples in Ray's own code that no raymoe frame claims count as "ray runtime"). Samples of a
thread blocked in the kernel (:data:`WAIT_FRAMES`: a futex sleep, a selector, a blocking pipe read) are set apart,
since py-spy (``--nonblocking``, Python frames only) reports such threads as active; counted as CPU, they had put
the driver of a dp=2 ep=2 engine at four times the CPU the kernel counted for it. The table's columns add up to
the CPU an average step costs in each process. One blind spot: the native shared-memory exchange
(``raymoe.platform.cpu.shm``) spins and sleeps inside one C call, which py-spy shows as that Python frame at work, so in
the rank columns "forward" holds those waits and the other categories' shares come out smaller than they are.
Needs ``py-spy`` (``pip install py-spy``).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from raymoe.bench.compare import _client, peer_env, stop_server, wait_healthy

# (category, frame patterns); a sample's deepest frame matching any pattern decides its category.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("forward", ("ModelRunner.forward ", "GraphRunner.replay", "ModelRunner.prepare")),
    ("sampling", ("Sampler.__call__",)),
    ("scheduling", ("Scheduler.", "apply_tbo_decision", "apply_graph_plan", "Driver._forget_finished",
                    "Driver.add_request", "Driver.abort_request")),
    ("fan-out", ("RayExecutor.launch", "RayExecutor.collect", "RayExecutor.execute", "LocalExecutor.launch",
                 "LocalExecutor.collect", "LocalExecutor.execute", "StepChannelHub.", "serve_steps (",
                 "RankWorker.step")),
    ("output handling", ("DriverService._delta", "DriverService._flush", "DriverService._apply",
                         "DriverActor._publish", "DriverActor._read", "EngineClient._read_outputs",
                         "EngineClient._send", "_deliver")),
    ("detokenization", ("IncrementalDetokenizer.push",)),
    ("stop strings / pieces", ("StopStringFilter.push", "stream_pieces")),
    ("SSE + HTTP", ("OpenAIServing._events", "EventRelay.", "ResponseBuilder.", "starlette/", "uvicorn/",
                    "fastapi/", "h11", "httptools", "sse (")),
    ("request intake", ("request_prep", "OpenAIServing.generate", "EngineClient.generate")),
    ("metrics", ("metrics.py", "prometheus_client")),
]


# Leaf frames of a thread that is blocked in the kernel (not using CPU), as py-spy names them.
WAIT_FRAMES: tuple[str, ...] = ("futex_wait (", "Selector.select (", "Connection._recv (", "Condition.wait (",
                                "Worker.main_loop (")
WAITING = "waiting (blocked)"


def classify(frames: list[str]) -> str:
    """Category of one sample (:data:`WAITING` for a blocked thread); ``frames`` run from the thread root to
    the leaf."""
    if frames and any(w in frames[-1] for w in WAIT_FRAMES):
        return WAITING
    for frame in reversed(frames):
        for name, patterns in CATEGORIES:
            if any(p in frame for p in patterns):
                return name
    return "ray runtime" if any("ray/" in f for f in frames) else "other"


def summarize(raw_file: Path) -> collections.Counter:
    """Samples per category in a py-spy ``--format raw`` file."""
    counts: collections.Counter = collections.Counter()
    for line in raw_file.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[classify(stack.split(";")[1:])] += int(n)
    return counts


def cpu_split(samples: collections.Counter, cpu_ms: float) -> dict[str, float]:
    """Split ``cpu_ms`` (a process's measured CPU, milliseconds) over the categories of its ``samples`` in
    proportion to their counts; :data:`WAITING` samples take no share. Empty when no sample was active."""
    active = {c: n for c, n in samples.items() if c != WAITING and n > 0}
    total = sum(active.values())
    return {c: cpu_ms * n / total for c, n in active.items()} if total else {}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads), from ``/proc/<pid>/stat``; 0.0 when
    the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _py_spy() -> str:
    """The py-spy next to this Python (the ``dev`` extra installs it), else the one on PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else "py-spy"


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _steps(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    m = re.search(r"^raymoe:engine_steps_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def add_profile_args(p) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the peers' tiny Qwen3-MoE)")
    p.add_argument("--peers", default="/tmp/peers")
    p.add_argument("--topology", default="dp=1", help="'dp=D,tp=T,ep=E' as in bench compare")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=2048,
                   help="requests the client sends; enough to keep the load up through the whole window")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seconds", type=float, default=15.0, help="py-spy window")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--port", type=int, default=8032)
    p.add_argument("--out", default="bench_results/profile_serve.json")
    p.add_argument("--keep-raw", default=None, help="folder to keep the raw py-spy samples in")


def run_profile(a) -> dict:
    """Run the profile described by ``a``; prints the table and writes JSON.

    Raises:
        RuntimeError: the client finished its ``--num-prompts`` requests before the window ended (the idle part
            would be charged to the steps).
    """
    peers = Path(a.peers)
    model = a.model or str(peers / "models/tiny-qwen3moe")
    url = f"http://127.0.0.1:{a.port}"
    layout = dict(kv.split("=") for kv in a.topology.split(","))
    cmd = [sys.executable, "-m", "raymoe.cli", "serve", "--model", model, "--served-model-name", "tiny",
           "--port", str(a.port)] + [x for k in ("dp", "tp", "ep") if k in layout for x in (f"--{k}", layout[k])]
    env = peer_env(peers)
    with tempfile.TemporaryDirectory(prefix="raymoe-profile-") as work:
        log = open(Path(work) / "serve.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        load = None
        try:
            wait_healthy(url, proc, 600)
            _client(a, peers, env, url, model, 4, work)  # warm-up
            procs = {"front end": [proc.pid], "driver actor": _pids("ray::DriverActor"),
                     "rank actors": _pids("ray::RankWorker"), "group actors": _pids("ray::GroupSchedulerActor")}
            procs = {name: pids for name, pids in procs.items() if pids}
            load = subprocess.Popen(
                [str(peers / "vllm/bin/python"), str(peers / "vllm_cli.py"), "bench", "serve", "--backend",
                 "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer",
                 model, "--dataset-name", "random", "--random-input-len", str(a.input_len),
                 "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts), "--ignore-eos",
                 "--max-concurrency", str(a.concurrency)], env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            time.sleep(8.0)  # the client's own start-up, then steady load
            s0, t0 = _steps(url), time.monotonic()
            cpu0 = {pid: cpu_seconds(pid) for pids in procs.values() for pid in pids}
            cpu0[load.pid] = cpu_seconds(load.pid)
            spies = [(name, pid, subprocess.Popen(
                [_py_spy(), "record", "-p", str(pid), "-o", f"{work}/{pid}.txt", "-f", "raw", "--threads",
                 "--nonblocking", "-r", str(a.rate), "-d", str(int(a.seconds))], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)) for name, pids in procs.items() for pid in pids]
            for _, _, spy in spies:
                spy.wait(timeout=a.seconds + 60)
            steps, window_s = max(1.0, _steps(url) - s0), time.monotonic() - t0
            cpu_ms = {pid: 1000.0 * (cpu_seconds(pid) - c) / steps for pid, c in cpu0.items()}  # per step
            if load.poll() is not None:  # idle time in the window would be charged to the steps
                raise RuntimeError(f"the client finished before the {a.seconds:.0f} s window ended ({steps:.0f} "
                                   f"steps): raise --num-prompts")
            load.terminate()  # the window is measured; the rest of the load is not needed
            load.wait(timeout=60)
            client_ms = cpu_ms.pop(load.pid)
            table: dict[str, dict[str, float]] = {}
            totals: dict[str, float] = {}  # per process name: kernel CPU ms per step (also where nothing sampled)
            waiting: dict[str, list[int]] = {}  # per process name: [blocked samples, all samples]
            for name, pid, _ in spies:
                raw = Path(f"{work}/{pid}.txt")
                if a.keep_raw and raw.exists():
                    Path(a.keep_raw).mkdir(parents=True, exist_ok=True)
                    (Path(a.keep_raw) / f"{name.replace(' ', '_')}-{pid}.txt").write_bytes(raw.read_bytes())
                samples = summarize(raw) if raw.exists() else collections.Counter()
                w = waiting.setdefault(name, [0, 0])
                w[0] += samples.get(WAITING, 0)
                w[1] += sum(samples.values())
                row = table.setdefault(name, {})
                totals[name] = totals.get(name, 0.0) + cpu_ms[pid]
                for cat, ms in cpu_split(samples, cpu_ms[pid]).items():
                    row[cat] = row.get(cat, 0.0) + ms
        finally:
            if load is not None and load.poll() is None:
                load.terminate()
            stop_server(proc)
            log.close()
    cats = [c for c, _ in CATEGORIES] + ["ray runtime", "other"]
    print(f"CPU ms per engine step ({steps:.0f} steps in {window_s:.1f} s, {a.topology}, "
          f"concurrency {a.concurrency}):")
    print(f"{'category':<24}" + "".join(f"{p:>14}" for p in table))
    for c in cats:
        vals = [table[p].get(c, 0.0) for p in table]
        if any(v >= 0.005 for v in vals):
            print(f"{c:<24}" + "".join(f"{v:>14.2f}" for v in vals))
    print(f"{'total (kernel CPU time)':<24}" + "".join(f"{totals[p]:>14.2f}" for p in table))
    blocked = {p: 100.0 * w / n if n else 0.0 for p, (w, n) in waiting.items()}
    print(f"{'% samples blocked':<24}" + "".join(f"{blocked.get(p, 0.0):>13.0f}%" for p in table))
    print(f"client (vllm bench serve, not sampled): {client_ms:.2f} CPU ms per step")
    print(f"wall ms per step: {1000.0 * window_s / steps:.2f} (py-spy's own sampling takes CPU from the cores too)")
    result = {"topology": a.topology, "concurrency": a.concurrency, "steps": steps, "seconds": window_s,
              "wall_ms_per_step": 1000.0 * window_s / steps, "cpu_ms_per_step": table,
              "cpu_ms_per_step_total": totals, "client_cpu_ms_per_step": client_ms,
              "blocked_sample_percent": blocked}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    return result
