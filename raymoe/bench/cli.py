"""``raymoe bench ...`` subcommands (benchmarks print figures and write JSON; they are not tests)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub, model_arg) -> None:
    """Register ``raymoe bench <kind>`` on the top-level subparsers ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    p = bench.add_parser("offline", help="offline throughput vs transformers generate")
    model_arg(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=10)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (best is reported)")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers generate")
    p.add_argument("--profile", action="store_true", help="profile raymoe decode steps (torch.profiler)")
    p.add_argument("--output-json", default="bench_results/offline.json")
    p.set_defaults(func=_run_offline)


def _run_offline(a: argparse.Namespace) -> None:
    from raymoe.bench.offline import run_offline

    run_offline(a)
