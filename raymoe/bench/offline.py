"""Offline throughput: raymoe ``Engine.generate`` vs the vLLM-CPU peer and transformers ``generate``.

Workload: ``num_prompts`` random prompts of ``input_len`` tokens (seeded), greedy, ``output_len`` tokens each with
EOS ignored. Throughput = generated tokens / wall seconds of the whole call (prefill included); the best of
``repeats`` timed runs after one warm-up run is reported. raymoe's KV pool is sized so that every prompt runs at
once (``max_total_tokens`` = prompts x (input + output) tokens, at least the engine default), as the peer's is.

Engines run one after the other in this command (raymoe, then the peer modes, then transformers), so their
figures share the machine's state; ratios are raymoe's tokens/s over each engine's. The per-token decode cost at N
running requests is ``(T(N, output_len) - T(N, 1)) / (N * (output_len - 1))`` with ``T(N, L)`` the best wall time
of ``generate`` for N prompts of L output tokens: the decode steps alone, every step with all N requests running.

Each raymoe row also reports its rank's resident weight bytes (one-rank engines). For an FP8 checkpoint the same
workload runs next on the unquantized checkpoint of the same seed (``--baseline-model``, else rebuilt from the
folder's ``raymoe_build.json``: ``raymoe.bench.weights``) and the report gives both byte counts and their ratio.
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


def _engine(model: str, dtype: str, max_running: int, tokens_per_req: int, prefill_tokens: int,
            max_total_tokens: int | None, **options):
    from raymoe import Engine

    kv = max_total_tokens or max(16384, max_running * tokens_per_req)
    return Engine(model, dtype=dtype, max_running_requests=max(max_running, 1), max_total_tokens=kv,
                  max_prefill_tokens=max(4096, prefill_tokens), **options)


def _run_fn(engine, prompts: list[list[int]], max_tokens: int, outs: list):
    from raymoe import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run() -> None:
        outs.clear()
        outs.extend(engine.generate(prompt_token_ids=prompts, sampling_params=params))

    return run


def bench_raymoe(model: str, prompts: list[list[int]], output_len: int, dtype: str, repeats: int,
                 profile: bool = False, decode_batches: tuple[int, ...] = (), max_total_tokens: int | None = None,
                 seed: int = 0, **options) -> dict:
    """Time ``Engine.generate`` on ``prompts``; returns figures (tokens/s, seconds) and, for each N in
    ``decode_batches``, the decode cost per output token with N requests running (``decode_cost``, microseconds;
    needs ``output_len >= 2``). ``options`` go to Engine (e.g. ``tp_size``, ``dp_size``, ``ep_size``,
    ``enable_tbo``)."""
    input_len = max(map(len, prompts), default=1)
    max_running = max((len(prompts), *decode_batches))
    engine = _engine(model, dtype, max_running, input_len + output_len, max_running * input_len, max_total_tokens,
                     **options)
    outs: list = []
    run = _run_fn(engine, prompts, output_len, outs)
    secs = _time(run, repeats)
    tokens = sum(len(o.token_ids) for o in outs)
    topo = (f"tp{options.get('tp_size', 1)}-dp{options.get('dp_size', 1)}-ep{options.get('ep_size', 1)}"
            f"{'-' + options['device'] if options.get('device', 'cpu') != 'cpu' else ''}"
            f"{'-no-overlap' if options.get('disable_overlap_schedule') else ''}")
    from raymoe.bench.weights import resident_weight_bytes

    quant = " fp8" if engine.model_config.quantization is not None else ""
    result = {"engine": f"raymoe[{topo}, {dtype}{quant}]", "seconds": secs, "output_tokens": tokens,
              "output_tok_per_s": tokens / secs, "steps": engine.driver.num_steps,
              "max_total_tokens": engine.config.cache.max_total_tokens,
              "weight_bytes": resident_weight_bytes(engine)}
    if decode_batches and output_len >= 2:
        vocab = engine.model_config.vocab_size
        known = {len(prompts): secs}
        result["decode_cost"] = [_decode_cost(engine, vocab, n, input_len, output_len, repeats, seed, known.get(n))
                                 for n in decode_batches]
    if profile:
        result["profile"] = _profile(run)
    engine.shutdown()
    return result


def _decode_cost(engine, vocab: int, n: int, input_len: int, output_len: int, repeats: int, seed: int,
                 full_seconds: float | None) -> dict:
    """Decode microseconds per output token with ``n`` requests running (module docstring)."""
    prompts = _prompts(vocab, n, input_len, seed)
    outs: list = []
    if full_seconds is None:
        full_seconds = _time(_run_fn(engine, prompts, output_len, outs), repeats)
    prefill_seconds = _time(_run_fn(engine, prompts, 1, outs), repeats)
    decode_seconds = max(full_seconds - prefill_seconds, 0.0)
    steps = output_len - 1
    return {"running_requests": n, "us_per_token": 1e6 * decode_seconds / (n * steps),
            "ms_per_step": 1e3 * decode_seconds / steps, "seconds": full_seconds, "prefill_seconds": prefill_seconds}


def _profile(run) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def bench_transformers(model: str, prompts: list[list[int]], output_len: int, dtype: str, repeats: int,
                       device: str = "cpu") -> dict:
    """Time transformers ``generate`` with the whole prompt set as one batch (equal lengths, no padding) on
    ``device`` (on CUDA each timed run ends when ``generate`` returns its ids, i.e. after the last kernel)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    out = {}

    def run() -> None:
        with torch.no_grad():
            out["seq"] = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                     min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            if device != "cpu":
                torch.cuda.synchronize()

    secs = _time(run, repeats)
    tokens = int((out["seq"].shape[1] - ids.shape[1]) * ids.shape[0])
    return {"engine": "transformers", "seconds": secs, "output_tokens": tokens, "output_tok_per_s": tokens / secs}


def run_offline(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench offline``: prints a table and writes JSON to ``a.output_json``."""
    from raymoe.bench.peer import PeerMode, peer_missing, run_peer
    from raymoe.cli_args import resolve_model
    from raymoe.config import ModelConfig

    model = resolve_model(a.model)
    vocab = ModelConfig.from_hf(model).vocab_size
    prompts = _prompts(vocab, a.num_prompts, a.input_len, a.seed)
    topo = {"tp_size": a.tp, "dp_size": a.dp, "ep_size": a.ep, "device": a.device,
            "disable_overlap_schedule": a.disable_overlap_schedule}
    if a.tp * a.dp > 1:
        topo["fanout"] = a.fanout
    decode_batches = tuple(int(n) for n in a.decode_batches.split(",") if n.strip())
    peer_modes = [PeerMode.parse(m) for m in a.peer_modes.split(",") if m.strip()]
    ours = bench_raymoe(model, prompts, a.output_len, a.dtype, a.repeats, a.profile, decode_batches,
                        a.max_total_tokens, a.seed, **topo)
    results = [ours]
    if ModelConfig.from_hf(model).quantization is not None and not a.skip_baseline:
        from raymoe.bench.weights import unquantized_twin

        baseline = a.baseline_model or str(unquantized_twin(model))
        results.append(bench_raymoe(baseline, prompts, a.output_len, a.dtype, a.repeats,
                                    max_total_tokens=a.max_total_tokens, seed=a.seed, **topo))
        results[-1]["baseline_model"] = baseline
        if ours["weight_bytes"] and results[-1]["weight_bytes"]:
            ours["weight_bytes_ratio"] = ours["weight_bytes"] / results[-1]["weight_bytes"]
    peer_note = None
    if a.skip_peer or not peer_modes:
        peer_note = "vLLM-CPU peer skipped (--skip-peer)"
    else:
        peer_note = peer_missing(a.peers_dir)
        if peer_note is None:
            results += [run_peer(a.peers_dir, model, m, a.num_prompts, a.output_len) for m in peer_modes]
    if not a.skip_hf:
        results.append(bench_transformers(model, prompts, a.output_len, a.dtype, a.repeats, a.device))
    for r in results[1:]:
        if "output_tok_per_s" in r:
            r["raymoe_ratio"] = ours["output_tok_per_s"] / r["output_tok_per_s"]
    report = {
        "workload": {"model": model, "num_prompts": a.num_prompts, "input_len": a.input_len,
                     "output_len": a.output_len, "dtype": a.dtype, "tp": a.tp, "dp": a.dp, "ep": a.ep,
                     "device": a.device},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "results": [{k: v for k, v in r.items() if k != "profile"} for r in results],
        "peer_note": peer_note,
    }
    _print_report(a, results, peer_note)
    path = Path(a.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return report


def _print_report(a: argparse.Namespace, results: list[dict], peer_note: str | None) -> None:
    print(f"workload: {a.num_prompts} prompts x {a.input_len} in / {a.output_len} out, greedy, EOS ignored")
    print(f"  {'engine':<36} {'output tok/s':>12} {'seconds':>8} {'raymoe / engine':>16} {'weight bytes':>13}")
    for r in results:
        if "error" in r:
            print(f"  {r['engine']:<36} failed: {r['error']}")
            continue
        ratio = f"{r['raymoe_ratio']:.2f}x" if "raymoe_ratio" in r else "-"
        wb = f"{r['weight_bytes']:,}" if r.get("weight_bytes") else "-"
        print(f"  {r['engine']:<36} {r['output_tok_per_s']:>12.0f} {r['seconds']:>8.3f} {ratio:>16} {wb:>13}")
    if "weight_bytes_ratio" in results[0]:
        print(f"  resident weight bytes, FP8 / unquantized ({results[1]['baseline_model']}): "
              f"{results[0]['weight_bytes_ratio']:.3f}x")
    if peer_note:
        print(f"  ({peer_note})")
    costs = results[0].get("decode_cost")
    if costs:
        print("raymoe decode cost per output token, N requests running:")
        print(f"  {'N':>5} {'us/token':>9} {'ms/step':>8}")
        for c in costs:
            print(f"  {c['running_requests']:>5} {c['us_per_token']:>9.1f} {c['ms_per_step']:>8.2f}")
    if a.profile and "profile" in results[0]:
        print(results[0]["profile"])
