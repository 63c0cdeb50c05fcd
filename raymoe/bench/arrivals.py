"""``raymoe bench arrivals``: TTFT and ITL when new conversations arrive while others decode, per server config.

Each configuration (``--configs``, ';'-separated ``NAME=EXTRA SERVER ARGS``) starts ``raymoe serve`` once on
127.0.0.1 in the same ``--topology``, optionally after the vLLM-CPU peer (``--with-peer``). Each server gets a short
warm-up of random prompts (not measured, and no prefix of the dataset, so the radix cache starts cold), then the
two-turn MT-Bench style workload of ``raymoe bench serve``: ``--num-prompts`` conversations arriving as a Poisson
process at ``--request-rate`` per second, at most ``--concurrency`` in flight, every turn ``--output-len`` tokens
(greedy, ``ignore_eos`` by default so every configuration does the same work). Arrivals are seeded, so every
server sees the same schedule. A server that exits before it is healthy (e.g. an unknown flag) fails its row with
the reason from its log; the other configurations still run. Prints one table (milliseconds) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

from raymoe.bench.compare import PEER_NAME, peer_env, peer_serve_cmd, raymoe_serve_cmd, stop_server, wait_healthy

DEFAULT_CONFIGS = "mixed-off=--no-enable-mixed-chunk;mixed-on=--enable-mixed-chunk"
DEFAULT_DATASET = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "mtbench_style.jsonl"
# Flags the benchmark sets itself: a configuration must not move the server it is polling.
_RESERVED_FLAGS = ("--model", "--served-model-name", "--host", "--port")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


def parse_configs(spec: str) -> list[tuple[str, list[str]]]:
    """``'a=--x 1;b='`` -> ``[('a', ['--x', '1']), ('b', [])]``: the named extra ``raymoe serve`` arguments.

    Raises ValueError on a part without ``=``, a bad, duplicate or reserved name, unbalanced quotes, arguments
    that do not start with a flag, or a flag the benchmark sets itself (model, host, port)."""
    configs: list[tuple[str, list[str]]] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, sep, rest = part.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"config {part!r} has no '=': expected NAME=EXTRA SERVER ARGS (the args may be empty)")
        if not _NAME.fullmatch(name):
            raise ValueError(f"bad config name {name!r}: use letters, digits and _.+-")
        if name == PEER_NAME:
            raise ValueError(f"config name {PEER_NAME!r} is reserved for the peer (--with-peer)")
        if any(name == n for n, _ in configs):
            raise ValueError(f"config name {name!r} appears twice")
        try:
            args = shlex.split(rest)
        except ValueError as e:
            raise ValueError(f"config {name!r}: {e}") from None
        if args and not args[0].startswith("-"):
            raise ValueError(f"config {name!r}: server args must start with a flag, got {args[0]!r}")
        for arg in args:
            if arg.split("=", 1)[0] in _RESERVED_FLAGS:
                raise ValueError(f"config {name!r}: {arg.split('=', 1)[0]} is set by the benchmark")
        configs.append((name, args))
    if not configs:
        raise ValueError(f"no configuration in {spec!r}")
    return configs


def failure_reason(log_text: str) -> str:
    """The most telling line of a failed server's log: the last one that mentions an error, else the last one."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(empty log)"])[-1][:300]


def client_args(a: argparse.Namespace, base_url: str, *, warmup: bool) -> argparse.Namespace:
    """The ``raymoe bench serve`` arguments of the measured run (or of the warm-up: random prompts, all at once)."""
    return argparse.Namespace(
        base_url=base_url, model=None, api_key=None, concurrency=a.concurrency, timeout=a.timeout, seed=a.seed,
        num_prompts=a.warmup_prompts if warmup else a.num_prompts,
        request_rate=float("inf") if warmup else a.request_rate,
        dataset_path=None if warmup else str(a.dataset_path), input_len=32, output_len=a.output_len,
        temperature=0.0, ignore_eos=True if warmup else a.ignore_eos)


def run_config(a: argparse.Namespace, name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> dict:
    """Start one server, warm it up, run the workload, stop it; a row with the client summary (latencies in ms)
    and ``failed``: None, or why the server did not start or died during the run."""
    from raymoe.bench.serve import run_benchmark

    url = f"http://127.0.0.1:{a.port}"
    log_path = log_dir / f"{name}.log"
    row: dict = {"config": name, "command": cmd, "log": str(log_path), "failed": None}
    print(f"[arrivals] starting {name}: {shlex.join(cmd)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_healthy(url, proc, a.start_timeout)
            except (RuntimeError, TimeoutError) as e:
                log.flush()
                row["failed"] = f"{e}: {failure_reason(log_path.read_text(errors='replace'))}"
                return row
            try:
                if a.warmup_prompts > 0:
                    asyncio.run(run_benchmark(client_args(a, url, warmup=True)))
                row.update(asyncio.run(run_benchmark(client_args(a, url, warmup=False))))
            except Exception as e:  # noqa: BLE001 - one configuration's failure is a row, not the end of the run
                row["failed"] = f"client: {type(e).__name__}: {e}"
            if proc.poll() is not None and not row["failed"]:
                log.flush()
                row["failed"] = (f"server exited with {proc.returncode} during the run: "
                                 f"{failure_reason(log_path.read_text(errors='replace'))}")
        finally:
            stop_server(proc)
    return row


def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def mean_in_flight(summary: dict) -> float | None:
    """Requests in flight on average over the run: the sum of their end-to-end latencies over its duration (shows
    whether the request rate kept the server busy; at most ``--concurrency``)."""
    mean_ms = summary["e2e_latency_ms"]["mean"]
    if mean_ms is None or not summary["duration_s"]:
        return None
    return mean_ms / 1000.0 * summary["completed"] / summary["duration_s"]


def format_table(rows: list[dict]) -> str:
    """One line per configuration: TTFT p50/p99, ITL p50/p99 and TPOT p50 (ms), output tokens/s, mean requests
    in flight, errors (failed requests; a failed server shows its reason instead of figures)."""
    head = (f"{'config':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}"
            f"{'out tok/s':>11}{'in flight':>11}{'errors':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "ttft_ms" not in r:
            lines.append(f"{r['config']:<16}FAILED: {r['failed']}")
            continue
        ttft, itl, tpot = r["ttft_ms"], r["itl_ms"], r["tpot_ms"]
        lines.append(f"{r['config']:<16}{_fmt(ttft['p50'], 10)}{_fmt(ttft['p99'], 10)}{_fmt(itl['p50'], 9)}"
                     f"{_fmt(itl['p99'], 9)}{_fmt(tpot['p50'], 10)}{_fmt(r['output_token_throughput'], 11, 0)}"
                     f"{_fmt(mean_in_flight(r), 11)}{r['errors']:>8}"
                     + (f"  FAILED: {r['failed']}" if r["failed"] else ""))
    return "\n".join(lines)


def add_arrivals_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``raymoe bench arrivals``."""
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="raymoe serve configurations, ';'-separated NAME=EXTRA SERVER ARGS (args may be empty)")
    p.add_argument("--topology", default="dp=1", help="layout of every raymoe server, as in bench compare: "
                                                      "'dp=D,tp=T,ep=E[,tbo=0|1][,fanout=..][,a2a=..]'")
    p.add_argument("--model", default=None, help="model folder (default: the peers' tiny Qwen3-MoE)")
    p.add_argument("--peers", default=os.environ.get("PEERS", "/tmp/peers"), help="peers install dir (setup.sh)")
    p.add_argument("--with-peer", action="store_true", help="also run the vLLM-CPU peer, first")
    p.add_argument("--dataset-path", type=Path, default=DEFAULT_DATASET, help="MT-Bench style two-turn jsonl")
    p.add_argument("--num-prompts", type=int, default=80, help="conversations (two requests each)")
    p.add_argument("--request-rate", type=float, default=4.0, help="new conversations per second (Poisson)")
    p.add_argument("--concurrency", type=int, default=16, help="conversations in flight at most")
    p.add_argument("--output-len", type=int, default=64, help="max tokens per turn (greedy)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="every turn generates exactly --output-len tokens")
    p.add_argument("--warmup-prompts", type=int, default=8, help="random prompts sent first, not measured (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be healthy")
    p.add_argument("--port", type=int, default=8033)
    p.add_argument("--log-dir", type=Path, default=Path("bench_results/arrivals_logs"), help="server logs")
    p.add_argument("--out", type=Path, default=Path("bench_results/arrivals.json"))


def run_arrivals(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench arrivals``: every server in turn, then the table and the JSON.

    Raises:
        SystemExit: bad options, a missing model, dataset or peer, a busy port, or (after the table and the JSON
            are written) a configuration whose server failed (exit status 1).
    """
    try:
        configs = parse_configs(a.configs)
        raymoe_serve_cmd("", a.port, a.topology)  # checks the topology string before anything starts
    except ValueError as e:
        raise SystemExit(f"raymoe bench arrivals: {e}") from None
    peers = Path(a.peers)
    model = a.model or str(peers / "models/tiny-qwen3moe")
    if not Path(model, "config.json").exists():
        raise SystemExit(f"no model at {model}: pass --model DIR (e.g. from `raymoe make-checkpoint`) or run "
                         "`bash ../shared/peers/setup.sh`")
    if not a.dataset_path.exists():
        raise SystemExit(f"no dataset at {a.dataset_path}")
    if a.with_peer and not (peers / "vllm/bin/python").exists():
        raise SystemExit(f"--with-peer: no peers under {peers}; run `bash ../shared/peers/setup.sh` first")
    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", a.port)) == 0:
            raise SystemExit(f"port {a.port} already has a server (its figures would be measured): pass --port")
    a.log_dir.mkdir(parents=True, exist_ok=True)
    runs = [(name, raymoe_serve_cmd(model, a.port, a.topology) + extra, dict(os.environ)) for name, extra in configs]
    if a.with_peer:
        runs.insert(0, (PEER_NAME, peer_serve_cmd(peers, model, a.port), peer_env(peers)))
    rows = []
    for name, cmd, env in runs:
        rows.append(run_config(a, name, cmd, env, a.log_dir))
        if rows[-1]["failed"]:
            print(f"[arrivals] config {name!r} FAILED: {rows[-1]['failed']} (log: {rows[-1]['log']})", flush=True)
    print(f"\nTTFT / ITL / TPOT in ms; {a.num_prompts} two-turn conversations, Poisson {a.request_rate}/s, "
          f"concurrency {a.concurrency}, {a.output_len} tokens per turn, {a.topology}, model {Path(model).name}")
    print(format_table(rows), flush=True)
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": model, "topology": a.topology,
              "dataset": str(a.dataset_path), "num_prompts": a.num_prompts, "request_rate": a.request_rate,
              "concurrency": a.concurrency, "output_len": a.output_len, "ignore_eos": a.ignore_eos,
              "warmup_prompts": a.warmup_prompts, "seed": a.seed, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    failed = [r["config"] for r in rows if r["failed"]]
    if failed:
        raise SystemExit(f"raymoe bench arrivals: configuration(s) failed: {', '.join(failed)}")
    return result
