"""``raymoe bench ...`` subcommands (benchmarks print figures and write JSON; they are not tests).

Imported by the top-level ``raymoe.cli``; it imports the benchmark modules and the shared ``raymoe.cli_args``, never
``raymoe.cli`` or ``raymoe.deploy.cli``. Engine option choices come from the declarations (``raymoe.config``).
"""

from __future__ import annotations

import os

from raymoe.bench.arrivals import add_arrivals_args, run_arrivals
from raymoe.bench.chaos import add_chaos_args, run_chaos
from raymoe.bench.compare import add_compare_args, run_compare
from raymoe.bench.driver_scale import add_driver_scale_args, run_driver_scale
from raymoe.bench.eplb import add_eplb_args, run_eplb_bench
from raymoe.bench.fanout import run_fanout
from raymoe.bench.frontend import add_frontend_args, run_frontend
from raymoe.bench.graph import run_graph_bench
from raymoe.bench.kv_transfer import add_kv_transfer_args, run_kv_transfer_bench
from raymoe.bench.offline import run_offline
from raymoe.bench.overlap import add_overlap_args, run_overlap_bench
from raymoe.bench.pd import add_pd_args, run_pd_bench
from raymoe.bench.profile_serve import add_profile_args, run_profile
from raymoe.bench.routing import add_routing_args, run_routing_bench
from raymoe.bench.serve import add_serve_bench_args, run_serve_bench
from raymoe.bench.spec import add_spec_args, run_spec_bench
from raymoe.bench.stress import add_stress_args, run_stress
from raymoe.cli_args import model_arg
from raymoe.config import engine_options

# Commands whose options live in their own module: (name, help, options function, entry point).
_MODULE_COMMANDS = (
    ("overlap", "two-batch overlap efficiency on gloo ranks with injected a2a latency", add_overlap_args,
     run_overlap_bench),
    ("compare", "raymoe serve vs the vLLM-CPU peer: same model, same client, one run", add_compare_args, run_compare),
    ("profile-serve", "py-spy breakdown of a served step over every engine process", add_profile_args, run_profile),
    ("frontend", "the HTTP front end's CPU per streamed token, in process, fed by a synthetic engine",
     add_frontend_args, run_frontend),
    ("serve", "streaming load against an OpenAI-compatible server: TTFT, ITL, throughput", add_serve_bench_args,
     run_serve_bench),
    ("arrivals", "TTFT/ITL p50/p99 of two-turn chats arriving during decoding, per server config (e.g. mixed "
                 "chunked prefill off/on), one run", add_arrivals_args, run_arrivals),
    ("stress", "thousands of concurrent short streams, some hanging up: nothing lost?", add_stress_args, run_stress),
    ("eplb", "expert load balancing on a skewed router: EPLB off, redundant experts, live rebalancing (throughput, "
             "step p50/p99, per-layer balance, the longest step while weights move)", add_eplb_args, run_eplb_bench),
    ("chaos", "faults while streams run (SIGKILL / SIGSTOP / slow rank, driver kill, node removal) on a "
              "multi-raylet cluster of its own: failed and resumed requests, longest pause, tokens checked",
     add_chaos_args, run_chaos),
    ("driver-scale", "the control plane's CPU per step and bytes per rank as dp and running requests grow, ranks "
                     "answering instantly", add_driver_scale_args, run_driver_scale),
    ("kv-transfer", "KV rows between two processes' pools: NIXL and the gloo fallback against memcpy (GB/s)",
     add_kv_transfer_args, run_kv_transfer_bench),
    ("pd", "prefill/decode disaggregation vs colocated: KV transfer GB/s, decode ITL under long-prompt arrivals",
     add_pd_args, run_pd_bench),
    ("routing", "prefix-aware vs least-loaded DP routing on multi-turn chats: prefix-cache hit rate (against the "
                "best possible) and TTFT, one run", add_routing_args, run_routing_bench),
    ("spec", "speculative decoding off and on: decode tok/s at batch 1, 8, 32, tokens per verify step, acceptance "
             "rate, one run", add_spec_args, run_spec_bench),
)


def add_bench_parser(sub) -> None:
    """Register ``raymoe bench <kind>`` on the top-level subparsers ``sub``."""
    options = engine_options()
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    p = bench.add_parser("offline", help="offline throughput vs the vLLM-CPU peer and transformers generate")
    model_arg(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=10)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (best is reported)")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers generate")
    p.add_argument("--skip-peer", action="store_true", help="do not run the vLLM-CPU peer")
    p.add_argument("--peers-dir", default=os.environ.get("RAYMOE_PEERS_DIR", "/tmp/peers"),
                   help="where ../shared/peers/setup.sh installed the peer (default: $RAYMOE_PEERS_DIR or /tmp/peers)")
    p.add_argument("--peer-modes", default="float32-eager,bfloat16-compiled",
                   help="peer runs, comma-separated <float32|bfloat16>-<eager|compiled>")
    p.add_argument("--decode-batches", default="64,128,256",
                   help="running-request counts N for raymoe's per-token decode cost (empty: skip)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="raymoe KV slots (default: enough for every prompt at once)")
    p.add_argument("--profile", action="store_true", help="profile raymoe decode steps (torch.profiler)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (world > 1 runs Ray rank actors)")
    p.add_argument("--dp", type=int, default=1, help="DP-attention groups")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (1 or tp*dp)")
    p.add_argument("--fanout", default=None, choices=options["fanout"].choices,
                   help="how steps reach the rank actors (default: the step channel on CPU, compiled graph on CUDA)")
    p.add_argument("--device", default="cpu", choices=options["device"].choices,
                   help="where raymoe's ranks and transformers run (the vLLM-CPU peer always runs on CPU)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="raymoe forms each step after the previous one finished (default: overlap scheduling)")
    p.add_argument("--baseline-model", default=None,
                   help="an FP8 --model's unquantized checkpoint to run beside it (default: rebuilt from the "
                        "folder's raymoe_build.json, same seed)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run an FP8 model's unquantized baseline")
    p.add_argument("--output-json", default="bench_results/offline.json")
    p.set_defaults(func=run_offline)

    p = bench.add_parser("fanout", help="per-step fan-out overhead: step channel, actor calls, Ray Compiled Graph")
    model_arg(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    p.add_argument("--output-json", default="bench_results/fanout.json")
    p.set_defaults(func=run_fanout)

    p = bench.add_parser("graph", help="decode step time: graph replay vs eager, per bucket")
    model_arg(p)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,24,32,48,64", help="buckets to capture and time")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per request, the decoded one included")
    p.add_argument("--max-context-len", type=int, default=128, help="table width a graph attends over")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="also time replay through torch.compile")
    p.add_argument("--device", default="cpu", choices=options["device"].choices)
    p.add_argument("--a2a-mode", default="auto", choices=options["a2a_mode"].choices,
                   help="MoE dispatch mode (auto: low-latency for decode, so CUDA graphs can capture it)")
    p.add_argument("--output-json", default="bench_results/graph.json")
    p.set_defaults(func=run_graph_bench)

    for name, help_, add_args, run in _MODULE_COMMANDS:
        p = bench.add_parser(name, help=help_)
        add_args(p)
        p.set_defaults(func=run)
