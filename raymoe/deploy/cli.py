"""The ``raymoe`` command line: make-checkpoint, generate, serve, bench, env."""

from __future__ import annotations

import argparse
import os
import sys

from raymoe.errors import InvalidRequestError, RaymoeError


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the demo checkpoint, "
                                                 "built on first use)")


def resolve_model(model: str | None) -> str:
    """``model`` or the demo checkpoint path (built with a progress bar the first time)."""
    if model:
        return model
    from raymoe.models.checkpoint import default_model_path

    return str(default_model_path(progress=True))


def _cmd_make_checkpoint(a: argparse.Namespace) -> None:
    from raymoe.models.checkpoint import make_checkpoint

    out = make_checkpoint(a.arch, a.out, seed=a.seed, num_layers=a.num_layers, hidden_size=a.hidden_size,
                          num_experts=a.num_experts, num_experts_per_tok=a.top_k, vocab_size=a.vocab_size,
                          max_shard_bytes=a.max_shard_bytes, progress=True)
    print(out)


def _cmd_generate(a: argparse.Namespace) -> None:
    from raymoe import Engine, SamplingParams

    model = resolve_model(a.model)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    with Engine(model, dtype=a.dtype, tp_size=a.tp, dp_size=a.dp, ep_size=a.ep, device=a.device,
                a2a_mode=a.a2a_mode) as engine:
        for prompt, out in zip(a.prompt, engine.generate(a.prompt, params), strict=True):
            print(prompt + out.text)
            print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)


def _cmd_env(a: argparse.Namespace) -> None:
    from raymoe.platform.backends import environment_report

    report = environment_report()
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")


def _cmd_serve(a: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from raymoe.deploy.server import run_server
    from raymoe.deploy.server_config import ServeOptions

    try:
        opts = ServeOptions(
            model=a.model, served_model_name=a.served_model_name, tp_size=a.tp, dp_size=a.dp, ep_size=a.ep,
            enable_tbo=a.enable_tbo, dtype=a.dtype, seed=a.seed, max_total_tokens=a.max_total_tokens,
            max_context_len=a.max_context_len, max_running_requests=a.max_running_requests,
            max_queued_requests=a.max_queued_requests, max_in_flight=a.max_in_flight,
            api_key=a.api_key or os.environ.get("RAYMOE_API_KEY"), ray_address=a.address, fanout=a.fanout,
            limits=_limits(a), a2a_mode=a.a2a_mode, chunked_prefill_size=a.chunked_prefill_size,
            enable_mixed_chunk=a.enable_mixed_chunk, disable_overlap_schedule=a.disable_overlap_schedule,
            cpu_threads=a.cpu_threads, cpu_rank_nice=a.cpu_rank_nice, cpu_comm=a.cpu_comm)
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidRequestError(".".join(map(str, first["loc"])), first["msg"]) from None
    run_server(opts, host=a.host, port=a.port, demo_request=a.demo_request, log_level=a.log_level)


_LIMIT_FLAGS = ("max_body_bytes", "max_stop_strings", "max_stop_string_chars", "default_timeout_s", "max_timeout_s",
                "max_stream_backlog_events", "max_stream_backlog_bytes")


def _limits(a: argparse.Namespace):
    """``ServerLimits`` from the ``--max-body-bytes`` ... flags that were given (the rest keep their defaults)."""
    from raymoe.deploy.server_config import ServerLimits

    return ServerLimits(**{k: getattr(a, k) for k in _LIMIT_FLAGS if getattr(a, k) is not None})


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (default: demo model, dp=2 ep=2, TBO on)")
    _model_arg(p)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per DP group")
    p.add_argument("--dp", type=int, default=2, help="DP-attention groups")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks: 1 or dp*tp (default: dp*tp)")
    p.add_argument("--enable-tbo", action=argparse.BooleanOptionalAction, default=None,
                   help="two-batch overlap of MoE layers (default: on when ep > 1 on CUDA ranks; off on CPU ranks, "
                        "where the shared-memory all-to-all leaves no latency to hide)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV slots per DP group")
    p.add_argument("--max-context-len", type=int, default=None, help="longest prompt + output, tokens")
    p.add_argument("--max-running-requests", type=int, default=None, help="decode batch limit per DP group")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="waiting requests per DP group before 429")
    p.add_argument("--chunked-prefill-size", type=int, default=None, help="prompt tokens per step (default 512)")
    p.add_argument("--enable-mixed-chunk", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill steps also decode the running requests (MIXED batches; default: on)")
    p.add_argument("--disable-overlap-schedule", action="store_true", default=None,
                   help="form each step after the previous one finished (default: the next step is formed and "
                        "sent while the ranks compute)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="intra-op threads of each CPU rank (default: (cores - 1) // ranks, at least 1)")
    p.add_argument("--cpu-rank-nice", type=int, default=None,
                   help="nice value of each CPU rank's step thread with more than one rank (default: -10 where "
                        "permitted; 0 leaves it): a preempted rank stalls every rank at the next MoE exchange")
    p.add_argument("--max-in-flight", type=int, default=None, help="HTTP requests served at once before 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $RAYMOE_API_KEY)")
    p.add_argument("--fanout", default=None, choices=["channel", "compiled", "remote"],
                   help="how steps reach the rank actors: the step channel (a local socket per rank; default for "
                        "CPU ranks), a Ray Compiled Graph (default for CUDA ranks) or plain actor calls")
    p.add_argument("--a2a-mode", default=None, choices=["normal", "low_latency", "auto"],
                   help="MoE all-to-all mode (default auto: fixed-shape low-latency dispatch for decode steps)")
    p.add_argument("--cpu-comm", default=None, choices=["auto", "shm", "gloo"],
                   help="what carries the MoE all-to-all between CPU ranks (default auto: shared memory when "
                        "every rank is on this node, else gloo)")
    p.add_argument("--address", default=None, help="Ray cluster to join, e.g. ray://head:10001 (default: a "
                                                   "local Ray on 127.0.0.1)")
    limits = p.add_argument_group("per-request limits (README: Limits and failure behaviour)")
    limits.add_argument("--max-body-bytes", type=int, default=None, help="largest request body (413 beyond)")
    limits.add_argument("--max-stop-strings", type=int, default=None, help="stop strings per request")
    limits.add_argument("--max-stop-string-chars", type=int, default=None, help="characters per stop string")
    limits.add_argument("--default-timeout-s", type=float, default=None, help="deadline of requests without timeout")
    limits.add_argument("--max-timeout-s", type=float, default=None, help="largest timeout a request may ask")
    limits.add_argument("--max-stream-backlog-events", type=int, default=None,
                        help="unsent SSE events before a reader counts as slow (its request is aborted)")
    limits.add_argument("--max-stream-backlog-bytes", type=int, default=None, help="the same bound in bytes")
    p.add_argument("--demo-request", action="store_true", help="once ready, send one chat completion and print it")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raymoe", description="Ray-native MoE serving engine")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-checkpoint", help="write a seeded tiny Hugging Face checkpoint")
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3", "deepseek_v2", "mixtral"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--max-shard-bytes", type=int, default=None)
    p.set_defaults(func=_cmd_make_checkpoint)

    p = sub.add_parser("generate", help="generate text offline")
    _model_arg(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (world > 1 runs Ray rank actors)")
    p.add_argument("--dp", type=int, default=1, help="DP-attention groups")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size: 1 or tp*dp")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when visible")
    p.add_argument("--a2a-mode", default="auto", choices=["normal", "low_latency", "auto"],
                   help="MoE all-to-all mode (auto: low-latency for decode steps)")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("env", help="print torch/CUDA/NCCL versions and which GPU backends import")
    p.set_defaults(func=_cmd_env)

    _add_serve_parser(sub)

    from raymoe.bench.cli import add_bench_parser

    add_bench_parser(sub, _model_arg)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``raymoe`` command; returns the exit status (2 for a raymoe error, printed without traceback)."""
    args = build_parser().parse_args(argv)
    if not getattr(args, "address", None):
        # A local Ray cluster must live on loopback; Ray fixes its address when first imported, so set the
        # environment now, before any command imports ray.
        from raymoe.cluster.bootstrap import use_loopback_environment

        use_loopback_environment()
    try:
        args.func(args)
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
