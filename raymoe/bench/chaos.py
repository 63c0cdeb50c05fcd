"""``raymoe bench chaos``: every fault of the harness (``raymoe.bench.chaos_faults``) on a multi-raylet cluster of
its own, and the table of what the streams saw.

The cluster is ``ray.cluster_utils.Cluster`` on 127.0.0.1: a head without GPUs and ``--worker-nodes`` nodes that
declare ``--gpus-per-node`` GPUs each (emulated: the ranks compute on CPU but reserve a GPU bundle each, so they land
on worker nodes as on a GPU cluster and a node can be taken away from under a rank). A served dp x ep engine
(``EngineClient`` and the OpenAI app, in this process) runs ``--streams`` greedy streams per fault; the faults run in
order, and after ``remove_node`` a fresh worker node joins (once the streams ended) so that the next fault starts at
full capacity. A benchmark: it prints the table and writes JSON; it needs its own Ray instance (it refuses to join
one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from raymoe.bench.chaos_faults import FAULTS, ChaosHarness, format_table


def add_chaos_args(p: argparse.ArgumentParser) -> None:
    """The options of ``raymoe bench chaos``."""
    p.add_argument("--model", default=None, help="model folder (default: a tiny Qwen3-MoE checkpoint built here)")
    p.add_argument("--dp", type=int, default=2, help="DP groups = EP ranks (one rank each)")
    p.add_argument("--redundant", type=int, default=8,
                   help="ep_num_redundant_experts (0: none; 8: at dp=2 each of the tiny model's 8 experts has a slot "
                        "on both ranks, so a lost rank shrinks the group onto the other: elastic EP)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--step-timeout", type=float, default=5.0, help="step_timeout_s: the watchdog's bound, seconds")
    p.add_argument("--worker-nodes", type=int, default=3)
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="GPUs each worker node declares (1: one rank per node, so remove_node costs one rank)")
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--output-json", default="bench_results/chaos.json")


def _worker(cluster, gpus: int):
    from raymoe.cluster.bootstrap import free_port

    return cluster.add_node(num_cpus=2, num_gpus=gpus, dashboard_agent_listen_port=free_port(),
                            metrics_export_port=free_port())


def run_chaos(a: argparse.Namespace) -> dict:
    """Run the faults of ``a`` on a fresh local cluster; prints the table and writes ``a.output_json``.

    Raises:
        RuntimeError: Ray is initialized in this process already (the bench removes nodes of its own cluster).
    """
    import ray
    from ray.cluster_utils import Cluster

    from raymoe.client.engine_client import EngineClient
    from raymoe.cluster.bootstrap import free_port
    from raymoe.config import engine_config_from_options
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.deploy.thread_server import serve_in_thread
    from raymoe.models.checkpoint import make_checkpoint
    from raymoe.paths import cache_dir

    if ray.is_initialized():
        raise RuntimeError("raymoe bench chaos starts a Ray cluster of its own; run it outside another Ray session")
    model = a.model or str(make_checkpoint("qwen3_moe", cache_dir() / "bench" / "chaos-qwen3_moe", seed=0))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "include_dashboard": False, "gcs_server_port": free_port(),
        "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port()})
    results = []
    engine = None
    try:
        for _ in range(a.worker_nodes):
            _worker(cluster, a.gpus_per_node)
        ray.init(address=cluster.address)
        options = {"dp_size": a.dp, "ep_size": a.dp, "device": "cpu", "bundle_gpus": True,
                   "step_timeout_s": a.step_timeout, "max_queued_requests": 4 * a.streams,
                   "ep_num_redundant_experts": a.redundant}
        engine = EngineClient(engine_config_from_options(model, options), model_name="chaos")
        app = build_openai_app(engine, max_in_flight=a.streams + 16)
        with serve_in_thread(app, backlog=a.streams + 64) as url:
            harness = ChaosHarness(engine, url, streams=a.streams, max_tokens=a.max_tokens, cluster=cluster,
                                   stream_timeout_s=300.0, add_node=lambda: _worker(cluster, a.gpus_per_node))
            t0 = time.perf_counter()
            harness.reference()
            print(f"undisturbed run: {a.streams} streams x {a.max_tokens} tokens in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            for fault in a.faults:
                results.append(harness.run(fault))
                print(format_table(results[-1:]), flush=True)
        table = format_table(results)
        print(f"\ndp={a.dp} x ep={a.dp}, ep_num_redundant_experts={a.redundant}, step_timeout_s={a.step_timeout}, "
              f"{a.streams} streams x {a.max_tokens} greedy tokens per fault\n{table}")
        for note in harness.notes:
            print(f"note: {note}")
        report = {"dp": a.dp, "redundant": a.redundant, "streams": a.streams, "max_tokens": a.max_tokens,
                  "step_timeout_s": a.step_timeout, "results": [dataclasses.asdict(r) for r in results],
                  "notes": harness.notes}
        out = Path(a.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        return report
    finally:
        if engine is not None:
            engine.shutdown()
        ray.shutdown()
        cluster.shutdown()
