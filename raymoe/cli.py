"""The ``raymoe`` command line: make-checkpoint, generate and env here; serve from ``raymoe.deploy.cli``; bench from
``raymoe.bench.cli``; eplb (``eplb dump``) from ``raymoe.eplb_cli``.

This module assembles the subcommands; the dependencies run one way (it imports deploy's, bench's and eplb's
parsers, they import neither it nor each other's command line; shared pieces live in ``raymoe.cli_args``).
"""

from __future__ import annotations

import argparse
import sys

from raymoe.bench.cli import add_bench_parser
from raymoe.cli_args import add_option_flags, given_options, model_arg, resolve_model
from raymoe.config import engine_options
from raymoe.eplb_cli import add_eplb_parser
from raymoe.errors import RaymoeError

GENERATE_OWN_FLAGS = ("seed",)
"""Engine options ``raymoe generate`` does not take as flags: its ``--seed`` seeds the requests' sampling."""


def _cmd_make_checkpoint(a: argparse.Namespace) -> None:
    from raymoe.models.checkpoint import make_checkpoint

    if a.arch == "eagle":  # a draft head for --target, trained
        from raymoe.models.train_eagle import train_eagle_head

        if a.target is None or (a.train_seconds is None and a.train_steps is None):
            raise SystemExit("make-checkpoint --arch eagle needs --target DIR and --train-seconds or --train-steps")
        report = train_eagle_head(a.target, a.out, a.train_seconds or 0.0, steps=a.train_steps, seed=a.seed,
                                  distill_steps=a.distill_steps)
        print(f"trained {report.steps} steps in {report.seconds:.0f} s: final loss {report.final_loss:.3f}"
              f"{_agreement(report)}")
        print(a.out)
        return
    out = make_checkpoint(a.arch, a.out, seed=a.seed, num_layers=a.num_layers, hidden_size=a.hidden_size,
                          num_experts=a.num_experts, num_experts_per_tok=a.top_k, vocab_size=a.vocab_size,
                          sliding_window=a.sliding_window, mxfp4=a.mxfp4, max_shard_bytes=a.max_shard_bytes,
                          progress=True, quant=a.quant, fp8_scheme=a.fp8_scheme, fp8_block=tuple(a.fp8_block),
                          moe_intermediate_size=a.moe_intermediate_size, router_skew=a.router_skew,
                          tokenizer=a.tokenizer)
    if a.train_seconds is not None or a.train_steps is not None:
        from raymoe.models.train_demo import train_checkpoint

        report = train_checkpoint(out, a.train_seconds or 0.0, steps=a.train_steps, seed=a.seed,
                                  mtp_distill_steps=a.distill_steps)
        mtp = f", MTP loss {report.final_mtp_loss:.3f}" if report.final_mtp_loss is not None else ""
        mtp += _agreement(report)
        print(f"trained {report.steps} steps in {report.seconds:.0f} s ({report.tokens} tokens): final loss "
              f"{report.final_loss:.3f}{mtp} (train_log.json)")
    print(out)


def _agreement(report) -> str:
    """The draft model's agreement with its target's greedy text before and after distillation, if it ran."""
    if report.draft_agreement is None:
        return ""
    before, after = report.draft_agreement
    return f", draft agreement with the target's greedy text {before:.2f} -> {after:.2f}"


def _generate_options() -> list[str]:
    return [name for name in engine_options() if name not in GENERATE_OWN_FLAGS]


def _cmd_generate(a: argparse.Namespace) -> None:
    from raymoe import Engine, SamplingParams

    model = resolve_model(a.model)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    with Engine(model, **given_options(a, _generate_options())) as engine:
        for prompt, out in zip(a.prompt, engine.generate(a.prompt, params), strict=True):
            print(prompt + out.text)
            print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)


def _cmd_env(a: argparse.Namespace) -> None:
    from raymoe.platform.backends import environment_report

    report = environment_report()
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")


def _add_make_checkpoint_parser(sub) -> None:
    p = sub.add_parser("make-checkpoint", help="write a seeded tiny Hugging Face checkpoint")
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3", "deepseek_v2", "mixtral",
                                                                  "gpt_oss", "qwen3_5_moe", "qwen3_next", "eagle"],
                   help="eagle: an EAGLE draft head for --target (a Qwen3-MoE folder), trained (speculative_algorithm "
                        "eagle, speculative_draft_model_path)")
    p.add_argument("--target", default=None, help="eagle: the target model's folder")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--moe-intermediate-size", type=int, default=64)
    p.add_argument("--sliding-window", type=int, default=16, help="gpt_oss: window of the sliding layers (tokens)")
    p.add_argument("--mxfp4", action="store_true", help="gpt_oss: write the experts as MXFP4 blocks and scales")
    p.add_argument("--max-shard-bytes", type=int, default=None)
    p.add_argument("--quant", choices=["fp8"], default=None,
                   help="store every projection in FP8 (float8_e4m3fn + scales, quantization_config in config.json)")
    p.add_argument("--fp8-scheme", choices=["block", "tensor", "channel"], default="block",
                   help="FP8 scales: per [bn, bk] block (weight_scale_inv, DeepSeek-V3's layout), per tensor or per "
                        "output channel (weight_scale)")
    p.add_argument("--fp8-block", type=int, nargs=2, default=[128, 128], metavar=("BN", "BK"),
                   help="FP8 block size [rows, columns] for --fp8-scheme block")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="copy DIR's tokenizer (tokenizer.json, its config and generation config) instead of training "
                        "one, e.g. a released model's; --vocab-size must hold its ids")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                   help="S >= 0: bias every MoE router so a few experts take most tokens, as in trained models "
                        "(Zipf-like by rank, other hot experts per layer, hot ones in the first half of the experts); "
                        "at S=1 the hottest eighth of the experts takes 73-98%% of the routed tokens with 16-64 "
                        "experts, 48-50%% (the cap) with 8 experts top-2; 0 (default): today's routers, byte-identical")
    p.add_argument("--train-seconds", type=float, default=None, metavar="T",
                   help="then train it on the Python standard library's source for T seconds of CPU wall time "
                        "(qwen3_moe, deepseek_v3 with one MTP layer, deepseek_v2, mixtral; raymoe.models.train_demo): "
                        "its text looks like Python and speculative drafts get accepted")
    p.add_argument("--train-steps", type=int, default=None, metavar="N",
                   help="train exactly N steps instead of --train-seconds (reproducible across machines)")
    p.add_argument("--distill-steps", type=int, default=0, metavar="N",
                   help="deepseek_v3's MTP layer or an eagle head: after training, train it N more steps alone on the "
                        "target's own greedy text (raymoe.models.draft_distill), so more of its drafts are accepted; "
                        "demo-trained-deepseek uses 1200")
    p.set_defaults(func=_cmd_make_checkpoint)


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline")
    model_arg(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed of the prompts (default: unseeded)")
    engine = p.add_argument_group("engine options (raymoe.config; world size tp*dp > 1 runs Ray rank actors)")
    add_option_flags(engine, (engine_options()[name] for name in _generate_options()))
    p.set_defaults(func=_cmd_generate)


def _add_serve_parser(sub) -> None:
    """``raymoe serve``'s flags (``raymoe.deploy.cli``); on a machine without the serving stack (pydantic, the web
    framework: a GPU box with torch alone, where the GPU check runs ``raymoe env`` and the benchmarks) a ``serve``
    that says what is missing, so every other subcommand still runs there."""
    try:
        from raymoe.deploy.cli import add_serve_parser
    except ModuleNotFoundError as e:
        missing = e.name
        p = sub.add_parser("serve", help=f"unavailable here: {missing} is not installed", prefix_chars="\0",
                           add_help=False)
        p.add_argument("args", nargs="*")  # (every flag taken as a word: the answer is the same)

        def unavailable(_a: argparse.Namespace) -> None:
            raise SystemExit(f"raymoe serve needs {missing}, which is not installed (pip install raymoe installs the "
                             "serving stack)")

        p.set_defaults(func=unavailable)
        return
    add_serve_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    """The ``raymoe`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="raymoe", description="Ray-native MoE serving engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_make_checkpoint_parser(sub)
    _add_generate_parser(sub)
    p = sub.add_parser("env", help="print torch/CUDA/NCCL versions and which GPU backends import")
    p.set_defaults(func=_cmd_env)
    _add_serve_parser(sub)
    add_bench_parser(sub)
    add_eplb_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``raymoe`` command; returns the exit status (2 for a raymoe error, printed without traceback)."""
    args = build_parser().parse_args(argv)
    if not (getattr(args, "ray_address", None) or getattr(args, "address", None)):
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
