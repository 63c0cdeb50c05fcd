"""``raymoe bench overlap``: overlap efficiency of two-batch overlap on ``ep`` gloo ranks with injected latency.

Runs :func:`raymoe.bench.overlap_rank.measure_rank` on ``ep`` spawned processes (``tp = 1``, ``dp = ep``: every
rank is a DP group decoding ``bs`` requests; ``--batch-sizes`` are per rank) with ``--threads-per-rank`` torch
threads each, then prints a table, writes JSON and saves a PNG of step time vs injected latency.

Overlap efficiency of a point = ``(serial_ms - tbo_ms) / min(compute_ms, comm_ms)``: the step time TBO saves as
a fraction of the most it could save if compute and communication overlapped perfectly (1.0). The model is a
seeded checkpoint built on first use (``--model`` uses another folder); see ``overlap_rank`` for what each
figure measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from raymoe.config import CPU_COMM_MODES

COLUMNS = [("a2a_mode", "a2a", "{}"), ("batch_size", "bs", "{:d}"), ("latency_ms", "lat ms", "{:.1f}"),
           ("compute_ms", "compute", "{:.2f}"),
           ("comm_ms", "comm", "{:.2f}"), ("serial_ms", "serial", "{:.2f}"), ("tbo_ms", "TBO", "{:.2f}"),
           ("tbo_compute_ms", "TBO cmp", "{:.2f}"), ("sbo_ms", "SBO", "{:.2f}"), ("efficiency", "eff", "{:.2f}"),
           ("efficiency_min", "eff min", "{:.2f}"), ("serial_latency_exposed", "lat exp", "{:.2f}"),
           ("tbo_latency_exposed", "TBO exp", "{:.2f}")]


def bench_model_path(a: argparse.Namespace) -> str:
    """``a.model``, or the seeded benchmark checkpoint of the requested sizes (built once in the cache folder)."""
    if a.model:
        return a.model
    from raymoe.models.checkpoint import make_checkpoint
    from raymoe.paths import cache_dir

    dims = dict(num_layers=a.num_layers, hidden_size=a.hidden_size, num_experts=a.num_experts,
                num_experts_per_tok=a.top_k, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                head_dim=a.head_dim, moe_intermediate_size=a.moe_intermediate_size)
    path = cache_dir() / ("bench-overlap-" + "-".join(f"{v}" for v in dims.values()))
    if not (path / "config.json").is_file():
        make_checkpoint("qwen3_moe", path, seed=0, **dims)
    return str(path)


def add_efficiency(points: list[dict]) -> list[dict]:
    """Add ``efficiency`` (from medians), ``efficiency_min`` (from per-variant minimum step times, less
    disturbed by other processes) and ``tbo_speedup`` to each point (in place); returns ``points``."""
    for p in points:
        p["efficiency"] = (p["serial_ms"] - p["tbo_ms"]) / min(p["compute_ms"], p["comm_ms"])
        p["efficiency_min"] = ((p["serial_min_ms"] - p["tbo_min_ms"])
                               / min(p["compute_min_ms"], p["comm_min_ms"]))
        p["tbo_speedup"] = p["serial_ms"] / p["tbo_ms"]
    return points


def format_table(points: list[dict]) -> str:
    """Fixed-width table of the points (times in ms per decode step)."""
    head = " ".join(f"{title:>8}" for _, title, _ in COLUMNS)
    rows = [" ".join(f"{fmt.format(p[key]):>8}" for key, _, fmt in COLUMNS) for p in points]
    return "\n".join([head, *rows])


def save_plot(points: list[dict], path: Path) -> None:
    """Step time vs injected latency, one panel per batch size: serial, TBO, SBO, compute-only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({p["batch_size"] for p in points})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.6), squeeze=False)
    for ax, bs in zip(axes[0], sizes, strict=True):
        for mode in sorted({p.get("a2a_mode", "normal") for p in points}):
            pts = sorted((p for p in points if p["batch_size"] == bs and p.get("a2a_mode", "normal") == mode),
                         key=lambda p: p["latency_ms"])
            lat = [p["latency_ms"] for p in pts]
            dash = "-" if mode == "normal" else "--"
            for key, label, marker in (("serial_ms", "serial (TBO off)", "o"), ("tbo_ms", "TBO", "s"),
                                       ("sbo_ms", "SBO", "^"), ("compute_ms", "compute only", "x")):
                ax.plot(lat, [p[key] for p in pts], marker + dash, label=f"{label}, {mode}")
        ax.set_title(f"decode, bs {bs} per rank")
        ax.set_xlabel("injected one-way a2a latency (ms)")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_overlap_bench(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench overlap``: prints the table, writes JSON and the PNG plot."""
    from raymoe.bench.overlap_rank import measure_rank
    from raymoe.bench.ranks import spawn_ranks
    from raymoe.config import ParallelConfig

    model = bench_model_path(a)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    latencies = [float(x) for x in a.latency_ms.split(",")]
    parallel = ParallelConfig(tp_size=1, dp_size=a.ep, ep_size=a.ep)
    print(f"model {model}; ep={a.ep} ranks x {a.threads_per_rank} thread(s), context {a.context_len} tokens, "
          f"all-to-all over {a.cpu_comm}")
    modes = ["normal", "low_latency"] if a.a2a_mode == "both" else [a.a2a_mode]
    points = []
    for mode in modes:
        print(f"a2a mode {mode}")
        per_rank = spawn_ranks(measure_rank, parallel, model, sizes, latencies, a.context_len, a.warmup, a.iters,
                               a.seed, mode, threads_per_rank=a.threads_per_rank, cpu_comm=a.cpu_comm)
        points += add_efficiency(per_rank[0])
    print(format_table(points))
    result = {"benchmark": "overlap", "model": model, "ep": a.ep, "a2a_mode": a.a2a_mode,
              "threads_per_rank": a.threads_per_rank, "cpu_comm": a.cpu_comm,
              "context_len": a.context_len, "iters": a.iters, "warmup": a.warmup, "cpu_count": os.cpu_count(),
              "platform": platform.platform(), "points": points}
    out = Path(a.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    save_plot(points, Path(a.plot))
    print(f"wrote {out} and {a.plot}")
    return result


def add_overlap_args(p: argparse.ArgumentParser) -> None:
    """Options of ``raymoe bench overlap``."""
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: a seeded benchmark "
                                                 "checkpoint of the sizes below, built on first use)")
    p.add_argument("--ep", type=int, default=2, help="ranks (= expert-parallel size = DP groups)")
    p.add_argument("--a2a-mode", default="both", choices=["normal", "low_latency", "both"],
                   help="MoE dispatch mode of the decode steps (both: normal, then low-latency, in one run)")
    p.add_argument("--batch-sizes", default="16,64,128", help="decode requests per rank")
    p.add_argument("--latency-ms", default="0,1,2,5", help="injected one-way all-to-all latencies")
    p.add_argument("--context-len", type=int, default=32, help="cached tokens per request")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate-size", type=int, default=512)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--cpu-comm", default="auto", choices=CPU_COMM_MODES,
                   help="what carries the all-to-all between the ranks (auto: shared memory on one node)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/overlap.json")
    p.add_argument("--plot", default="bench_results/overlap.png")
