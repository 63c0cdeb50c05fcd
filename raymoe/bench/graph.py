"""Decode step time: graph replay vs eager, per captured bucket (``raymoe bench graph``).

Workload: one rank, ``bs`` requests whose ``seq_len`` tokens are already in the KV cache (random ids, seeded);
each timed step decodes one token for all of them (the same step again each time, so the cache does not grow).
A step is ``ModelRunner.forward_batch_generation`` (slot-table write, forward, greedy sampling): eager, or replay
of bucket ``bs`` (CUDA graph with ``--device cuda``; CPU: static-buffer callable, optionally through
``torch.compile``). Every step ends with the sampled ids on the host, so CUDA steps are timed to completion.
Eager and replay steps are interleaved; the median of ``iters`` steps after ``warmup`` is reported. A graph always
attends over the whole table width (``max_context_len``), eager only over the batch's longest sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from raymoe.comm.expert_input import resolve_a2a_mode
from raymoe.config import GraphConfig, MoeCommConfig
from raymoe.runner.model_runner import ModelRunner
from raymoe.runner.runner_config import RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch


def _batches(bs: int, seq_len: int, width: int, vocab: int, seed: int) -> tuple[ModelWorkerBatch, ModelWorkerBatch]:
    """(prefill of ``bs`` prompts of ``seq_len - 1`` tokens, the decode step that follows it); request ``r`` uses
    table row ``r`` and slots ``1 + r * width + position``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (bs, seq_len), generator=g).tolist()
    greedy = SamplingInputs.greedy(bs)
    plen = seq_len - 1
    rows = list(range(bs))
    prefill = ModelWorkerBatch(ForwardMode.EXTEND, [t for p in ids for t in p[:plen]], rows, [plen] * bs,
                               [0] * bs, [plen] * bs, [1 + r * width + i for r in rows for i in range(plen)],
                               sampling=greedy)
    decode = ModelWorkerBatch(ForwardMode.DECODE, [p[plen] for p in ids], rows, [seq_len] * bs, [plen] * bs,
                              [1] * bs, [1 + r * width + plen for r in rows], sampling=greedy)
    return prefill, decode


def _median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def bench_runner(runner: ModelRunner, sizes: list[int], seq_len: int, iters: int, warmup: int,
                 seed: int) -> list[dict]:
    """Per bucket: median eager and replay step times (ms) and whether both sampled the same tokens."""
    width = runner.cfg.max_context_len
    vocab = runner.model_config.vocab_size
    prefill, _ = _batches(max(sizes), seq_len, width, vocab, seed)
    runner.forward(runner.prepare(prefill))
    rows = []
    for bs in sizes:
        _, decode = _batches(bs, seq_len, width, vocab, seed)
        if resolve_a2a_mode(runner.cfg.moe_comm.a2a_mode, True) == "low_latency":  # as the driver plans decode steps
            decode = replace(decode, dispatch_capacity=bs)
        graph = replace(decode, graph_bs=bs)
        eager_t, graph_t = [], []
        for i in range(warmup + iters):
            for batch, times in ((decode, eager_t), (graph, graph_t)):
                t0 = time.perf_counter()
                out = runner.forward_batch_generation(batch)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                if batch is decode:
                    eager_tokens = out.next_token_ids
                else:
                    same = out.next_token_ids == eager_tokens
        e, r = _median_ms(eager_t), _median_ms(graph_t)
        rows.append({"batch_size": bs, "eager_ms": e, "graph_ms": r, "speedup": e / r, "same_tokens": same})
    return rows


def run_graph_bench(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench graph``: prints a table and writes JSON to ``a.output_json``."""
    from raymoe.cli_args import resolve_model

    model = resolve_model(a.model)
    sizes = sorted({int(s) for s in a.batch_sizes.split(",")})
    if a.seq_len + 1 > a.max_context_len:
        raise SystemExit("--seq-len must be below --max-context-len")
    variants = [("static", False)] + ([("compile", True)] if a.compile else [])
    report: dict = {
        "workload": {"model": model, "dtype": a.dtype, "device": a.device, "a2a_mode": a.a2a_mode,
                     "seq_len": a.seq_len, "max_context_len": a.max_context_len,
                     "iters": a.iters, "warmup": a.warmup, "batch_sizes": sizes},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "variants": {},
    }
    for name, compiled in variants:
        t0 = time.perf_counter()
        cfg = RunnerConfig(model, a.dtype, num_kv_slots=max(sizes) * a.max_context_len, max_req_rows=max(sizes),
                           max_context_len=a.max_context_len, device=a.device,
                           moe_comm=MoeCommConfig(a2a_mode=a.a2a_mode),
                           graph=GraphConfig(cuda_graph_bs=tuple(sizes), enable_torch_compile=compiled))
        runner = ModelRunner(cfg)
        init_s = time.perf_counter() - t0
        rows = bench_runner(runner, sizes, a.seq_len, a.iters, a.warmup, a.seed)
        report["variants"][name] = {"capture_seconds": runner.graph_runner.capture_seconds, "init_seconds": init_s,
                                    "rows": rows}
        print(f"graph replay '{name}'{' (torch.compile)' if compiled else ''}: captured {len(sizes)} buckets in "
              f"{runner.graph_runner.capture_seconds:.2f} s; seq_len {a.seq_len}, table width {a.max_context_len}, "
              f"{a.dtype} on {a.device}, a2a {a.a2a_mode}, median of {a.iters} steps")
        print(f"  {'bs':>4} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'same tokens':>12}")
        for r in rows:
            print(f"  {r['batch_size']:>4} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} {r['speedup']:>7.2f}x "
                  f"{str(r['same_tokens']):>12}")
    path = Path(a.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return report
