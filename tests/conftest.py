"""Shared fixtures: one seeded tiny Qwen3-MoE checkpoint per test session."""

from __future__ import annotations

import os

import pytest

# Keep every Ray process and gloo socket of the test session on loopback (read by Ray when it is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")



@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 4-layer, hidden-128, 8-expert (top-2) Qwen3-MoE folder with a trained BPE tokenizer (seed 0)."""
    from raymoe.models.checkpoint import make_checkpoint

    return str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe_tiny", seed=0))


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray instance for the whole session: three nodes that each declare 2 GPUs (``ray.cluster_utils.Cluster``;
    the head also has 8 logical CPUs, the workers 2), all on 127.0.0.1; CPU-only worlds place anywhere."""
    import ray
    from ray.cluster_utils import Cluster

    from raymoe.cluster.bootstrap import free_port

    # Free ports everywhere, so the suite can run beside another Ray instance on the same machine.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "num_gpus": 2, "include_dashboard": False, "gcs_server_port": free_port(),
        "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port()})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2, dashboard_agent_listen_port=free_port(),
                         metrics_export_port=free_port())
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
