"""Offline throughput: raymoe ``Engine.generate`` vs transformers ``generate`` on the same prompts.

Workload: ``num_prompts`` random prompts of ``input_len`` tokens (seeded), greedy, ``output_len`` tokens each with
EOS ignored. Throughput = generated tokens / wall seconds of the whole call (prefill included); the best of
``repeats`` timed runs after one warm-up run is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_raymoe(model: str, prompts: list[list[int]], output_len: int, dtype: str, repeats: int,
                 profile: bool = False, **options) -> dict:
    """Time ``Engine.generate`` on ``prompts``; returns figures (tokens/s, seconds). ``options`` go to Engine
    (e.g. ``tp_size``, ``dp_size``, ``ep_size``, ``enable_tbo``)."""
    from raymoe import Engine, SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = Engine(model, dtype=dtype, max_running_requests=max(len(prompts), 1),
                    max_prefill_tokens=max(4096, sum(map(len, prompts))), **options)
    outs = []

    def run() -> None:
        outs.clear()
        outs.extend(engine.generate(prompt_token_ids=prompts, sampling_params=params))

    secs = _time(run, repeats)
    tokens = sum(len(o.token_ids) for o in outs)
    topo = f"tp{options.get('tp_size', 1)}-dp{options.get('dp_size', 1)}-ep{options.get('ep_size', 1)}"
    result = {"engine": f"raymoe[{topo}]", "seconds": secs, "output_tokens": tokens,
              "output_tok_per_s": tokens / secs,
              "steps": engine.driver.num_steps}
    if profile:
        result["profile"] = _profile(run)
    engine.shutdown()
    return result


def _profile(run) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def bench_transformers(model: str, prompts: list[list[int]], output_len: int, dtype: str, repeats: int) -> dict:
    """Time transformers ``generate`` with the whole prompt set as one batch (equal lengths, no padding)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    ids = torch.tensor(prompts)
    out = {}

    def run() -> None:
        with torch.no_grad():
            out["seq"] = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                     min_new_tokens=output_len, do_sample=False, pad_token_id=0)

    secs = _time(run, repeats)
    tokens = int((out["seq"].shape[1] - ids.shape[1]) * ids.shape[0])
    return {"engine": "transformers", "seconds": secs, "output_tokens": tokens, "output_tok_per_s": tokens / secs}


def run_offline(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench offline``: prints a table and writes JSON to ``a.output_json``."""
    from raymoe.config import ModelConfig
    from raymoe.deploy.cli import resolve_model

    model = resolve_model(a.model)
    vocab = ModelConfig.from_hf(model).vocab_size
    prompts = _prompts(vocab, a.num_prompts, a.input_len, a.seed)
    topo = {"tp_size": a.tp, "dp_size": a.dp, "ep_size": a.ep}
    if a.tp * a.dp > 1:
        topo["fanout"] = a.fanout
    results = [bench_raymoe(model, prompts, a.output_len, a.dtype, a.repeats, a.profile, **topo)]
    if not a.skip_hf:
        results.append(bench_transformers(model, prompts, a.output_len, a.dtype, a.repeats))
    report = {
        "workload": {"model": model, "num_prompts": a.num_prompts, "input_len": a.input_len,
                     "output_len": a.output_len, "dtype": a.dtype, "tp": a.tp, "dp": a.dp, "ep": a.ep},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "results": [{k: v for k, v in r.items() if k != "profile"} for r in results],
    }
    print(f"workload: {a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, {a.dtype}, greedy")
    for r in results:
        print(f"  {r['engine']:>22}: {r['output_tok_per_s']:9.0f} output tok/s  ({r['seconds']:.3f} s, "
              f"{r['output_tokens']} tokens)")
    if a.profile and "profile" in results[0]:
        print(results[0]["profile"])
    path = Path(a.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return report
