"""``raymoe bench spec``: speculative decoding off and on, decode tokens per second at several batch sizes, one run.

Workload: ``N`` prompts of ``--input-len`` tokens cut from the Python standard library's source (the corpus the demo
tokenizer is trained on, seeded offsets: text that repeats itself the way code does), greedy (``--temperature``
to sample), ``--output-len`` tokens each with EOS ignored, for each ``N`` of ``--batches``. For every method (off,
then each of ``--algorithms``) one engine serves all batch sizes, one after the other, so their figures share the
machine's state.

Decode throughput at ``N`` running requests = ``N * (output_len - 1) / (T(N, output_len) - T(N, 1))``, with
``T(N, L)`` the best wall time of ``Engine.generate`` over ``--repeats`` runs after a warm-up: the decode steps
alone, prefill removed. With speculation each verify step also reports its acceptance: the mean tokens a request
gains per verify step (accepted drafts + the target's own token) and the acceptance rate (accepted / proposed
drafts), from the engine's counters (``raymoe.scheduler.spec_steps.SpecCounters``) over the timed runs. A
benchmark: it prints figures and writes JSON, it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

from raymoe.bench.offline import _time


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """The options of ``raymoe bench spec``."""
    p.add_argument("--model", default=None, help="model folder (default: the demo checkpoint)")
    p.add_argument("--algorithms", default="ngram", help="comma-separated speculative_algorithm values to compare "
                                                         "with speculation off; ALGO/fixed runs it with "
                                                         "speculative_draft_policy fixed (default: adaptive)")
    p.add_argument("--draft-model", default=None, help="eagle: the draft head's folder (speculative_draft_model_path)")
    p.add_argument("--num-steps", type=int, default=4, help="speculative_num_steps (drafts per request and step)")
    p.add_argument("--batches", default="1,8,32", help="running requests to measure at, comma-separated")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (the best is kept)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/spec.json")


def source_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, each a seeded slice of one standard-library source file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 8 * length)
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        ids = tokenizer.encode(rng.choice(files).read_text(errors="replace"))
        if len(ids) > length + 1:
            start = rng.randrange(len(ids) - length)
            prompts.append(ids[start:start + length])
    return prompts


def measure(engine, prompts: list[list[int]], output_len: int, temperature: float, repeats: int) -> dict:
    """Decode figures of ``engine`` for ``prompts`` (module docstring)."""
    from raymoe import SamplingParams
    from raymoe.scheduler.spec_steps import SpecCounters

    def run(max_tokens: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=1)
        return lambda: engine.generate(prompt_token_ids=prompts, sampling_params=params)

    def counters() -> SpecCounters:
        return SpecCounters.total(s.spec for s in engine.driver.group_stats()) or SpecCounters()

    before = counters()
    full = _time(run(output_len), repeats)
    after = counters()
    prefill = _time(run(1), repeats)
    n = len(prompts)
    decode = max(full - prefill, 1e-9)
    rows = sum(after.accept_len_counts) - sum(before.accept_len_counts)
    drafts, accepted = after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens
    return {"running_requests": n, "decode_tok_per_s": n * (output_len - 1) / decode, "decode_seconds": decode,
            "verify_steps": after.verify_steps - before.verify_steps,
            "tokens_per_verify_row": 1.0 + accepted / rows if rows else None,
            "acceptance_rate": accepted / drafts if drafts else None}


def run_spec_bench(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench spec``: prints a table and writes JSON to ``a.output_json``."""
    from raymoe import Engine
    from raymoe.cli_args import resolve_model

    model = resolve_model(a.model)
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    methods = [None] + [m.strip() for m in a.algorithms.split(",") if m.strip()]
    results = []
    for method in methods:
        spec = {}
        if method is not None:
            algo, _, policy = method.partition("/")
            spec = {"speculative_algorithm": algo, "speculative_num_steps": a.num_steps,
                    "speculative_draft_policy": policy or "adaptive"}
            if algo == "eagle":
                spec["speculative_draft_model_path"] = a.draft_model
        kv = max(16384, max(batches) * (a.input_len + a.output_len + a.num_steps + 1))
        with Engine(model, dtype=a.dtype, max_running_requests=max(batches), max_total_tokens=kv,
                    max_context_len=a.input_len + a.output_len + a.num_steps + 8, **spec) as engine:
            for n in batches:
                prompts = source_prompts(engine.tokenizer, n, a.input_len, a.seed)
                row = measure(engine, prompts, a.output_len, a.temperature, a.repeats)
                row["method"] = method or "off"
                results.append(row)
                print(_line(row), flush=True)
    off = {r["running_requests"]: r["decode_tok_per_s"] for r in results if r["method"] == "off"}
    for r in results:
        r["speedup_vs_off"] = r["decode_tok_per_s"] / off[r["running_requests"]]
    print("\nmethod   batch  decode tok/s  vs off  tokens/verify row  acceptance")
    for r in results:
        print(_line(r))
    report = {"workload": {"model": model, "batches": batches, "input_len": a.input_len,
                           "output_len": a.output_len, "temperature": a.temperature, "num_steps": a.num_steps,
                           "dtype": a.dtype}, "results": results}
    path = Path(a.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return report


def _line(r: dict) -> str:
    per_row = f"{r['tokens_per_verify_row']:.2f}" if r.get("tokens_per_verify_row") else "-"
    rate = f"{r['acceptance_rate']:.2f}" if r.get("acceptance_rate") is not None else "-"
    ratio = f"{r['speedup_vs_off']:.2f}x" if "speedup_vs_off" in r else ""
    return f"{r['method']:<8} {r['running_requests']:>5}  {r['decode_tok_per_s']:>12.0f}  {ratio:>6}  {per_row:>17}  " \
           f"{rate:>10}"
