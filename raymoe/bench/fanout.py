"""Fan-out overhead: per-step cost of reaching every rank over the step channel, with plain actor calls, and through a
Ray Compiled Graph.

Each timed step sends an IDLE batch (zero tokens) to every rank of a ``dp x tp`` world, so the ranks still run
the layers and every MoE collective on empty tensors; ``overhead = wall step time - slowest rank's own time``
isolates what the fan-out itself costs (serialization, scheduling, result transfer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _measure(executor, dp: int, steps: int, warmup: int) -> dict:
    from raymoe.step.worker_batch import ModelWorkerBatch

    batches = [ModelWorkerBatch.idle(tuple([0] * dp)) for _ in range(dp)]
    for _ in range(warmup):
        executor.execute(batches)
    walls, overheads = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = executor.execute(batches)
        wall = time.perf_counter() - t0
        walls.append(wall)
        overheads.append(wall - max(o.forward_seconds for o in outs))
    return {"step_ms_p50": 1e3 * statistics.median(walls), "step_ms_mean": 1e3 * statistics.fmean(walls),
            "overhead_ms_p50": 1e3 * statistics.median(overheads),
            "overhead_ms_mean": 1e3 * statistics.fmean(overheads)}


def run_fanout(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench fanout``: prints a table and writes JSON to ``a.output_json``."""
    from raymoe.actors.executor import RayExecutor
    from raymoe.cli_args import resolve_model
    from raymoe.cluster.bootstrap import init_ray
    from raymoe.config import FANOUTS, ParallelConfig
    from raymoe.runner.runner_config import RunnerConfig

    model = resolve_model(a.model)
    init_ray(a.address)
    parallel = ParallelConfig(tp_size=a.tp, dp_size=a.dp, ep_size=a.tp * a.dp)
    cfg = RunnerConfig(model_path=model, dtype="float32", num_kv_slots=256, max_req_rows=8, max_context_len=256)
    rows = []
    for fanout in FANOUTS:
        ex = RayExecutor(cfg, parallel, use_gpu=False, fanout=fanout)
        try:
            rows.append({"fanout": ex.fanout, **_measure(ex, a.dp, a.steps, a.warmup)})
        finally:
            ex.shutdown()
    print(f"fan-out of IDLE steps to {parallel.world_size} ranks (tp={a.tp}, dp={a.dp}), {a.steps} steps")
    print(f"{'fanout':>10} {'step p50 ms':>12} {'overhead p50 ms':>16} {'overhead mean ms':>17}")
    for r in rows:
        print(f"{r['fanout']:>10} {r['step_ms_p50']:12.3f} {r['overhead_ms_p50']:16.3f} {r['overhead_ms_mean']:17.3f}")
    report = {"world": parallel.world_size, "tp": a.tp, "dp": a.dp, "steps": a.steps, "results": rows}
    path = Path(a.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return report
