"""Node-ordered placement of GPU worlds on the session's Ray cluster of emulated GPU nodes (``place_ranks`` following
``raymoe.cluster.rank_plan``), proven with probes instead of rank workers: a probe task takes a rank's bundle with
the rank actor's resources and reports its node, ``ray.get_gpu_ids()`` and ``CUDA_VISIBLE_DEVICES``. (Tasks run
one after another in one worker process per node; sixteen rank actors would be sixteen processes on two cores.)

On the session's three nodes of 2 GPUs, then on two temporary nodes of 8 GPUs (dp=16 ep=16 with DeepEP's NVLink
domains, dp=4 tp=4) and on three temporary nodes of 4 GPUs (dp=6 tp=2): rank r sits on the r // G-th node as
bundle r % G, every node's ranks hold distinct GPUs, and the CUDA device each rank would take
(``rank_cuda_devices``) is GPU r % G of its node, the one Ray reserved for it."""

from __future__ import annotations

import os

import pytest

from raymoe.cluster.placement import gpu_node_inventory, place_ranks, release
from raymoe.cluster.rank_plan import nvlink_domain, plan_gpu_ranks, rank_cuda_devices
from raymoe.config import ParallelConfig
from raymoe.errors import PlacementError

CPUS_PER_RANK = 0.25  # logical CPUs of a bundle: 8 bundles fit a temporary node of 2 CPUs


def probe(placements) -> list[tuple[str, list[str], str | None]]:
    """(node id, Ray GPU ids, CUDA_VISIBLE_DEVICES) of a task in each rank's bundle, with the rank's resources."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def where_am_i() -> tuple[str, list[str], str | None]:  # nested: Ray ships it by value (no test module import)
        return (ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()],
                os.environ.get("CUDA_VISIBLE_DEVICES"))

    task = ray.remote(where_am_i)
    return [ray.get(task.options(num_cpus=p.num_cpus, num_gpus=p.num_gpus, scheduling_strategy=(
        PlacementGroupSchedulingStrategy(p.pg, placement_group_bundle_index=p.bundle_index))).remote(), timeout=120)
        for p in placements]


def check_node_ordered(cfg: ParallelConfig, plan, placements, node_ids: list[str]) -> None:
    """The placement follows ``plan`` on the nodes ``node_ids``, and each rank's CUDA device is its GPU."""
    import ray

    g = plan.gpus_per_node
    seen = probe(placements)
    assert [p.rank for p in placements] == list(range(cfg.world_size))
    assert [p.bundle_index for p in placements] == [r % g for r in range(cfg.world_size)]
    nodes = [node for node, _, _ in seen]
    assert [p.node_id for p in placements] == nodes
    assert set(nodes) <= set(node_ids)
    for k in range(plan.num_nodes):
        assert {nodes[r] for r in plan.node_ranks(k)} == {nodes[k * g]}
    assert len({nodes[k * g] for k in range(plan.num_nodes)}) == plan.num_nodes
    gpu_ids = [ids for _, ids, _ in seen]
    # Ray shows a rank only its own GPU; on a fresh node bundle b holds GPU b
    assert [visible for _, _, visible in seen] == [ids[0] for ids in gpu_ids]
    assert gpu_ids == [[str(r % g)] for r in range(cfg.world_size)]
    devices = rank_cuda_devices([p.node_id for p in placements], gpu_ids)
    assert [d.device_index for d in devices] == [r % g for r in range(cfg.world_size)]
    assert [d.visible_devices.split(",")[d.device_index] for d in devices] == [ids[0] for ids in gpu_ids]
    tables = {p.pg.id.hex(): ray.util.placement_group_table(p.pg) for p in placements}
    assert sorted(t["name"].split("-")[1] for t in tables.values()) == [f"node{k}" for k in range(plan.num_nodes)]
    for t in tables.values():
        assert t["strategy"] == "STRICT_PACK" and all(b.get("GPU") == 1.0 for b in t["bundles"].values())


def test_node_ordered_placement_on_the_session_nodes(ray_cluster):
    """Three nodes of 2 GPUs, dp=3 tp=2: one TP group per node, bundles in rank order."""
    inventory = gpu_node_inventory()
    assert sorted(inventory.values()) == [2.0, 2.0, 2.0]
    cfg = ParallelConfig(tp_size=2, dp_size=3, ep_size=6)
    placements = place_ranks(cfg, use_gpu=True, cpus_per_rank=CPUS_PER_RANK, timeout_s=60)
    try:
        check_node_ordered(cfg, plan_gpu_ranks(inventory, cfg), placements, list(inventory))
    finally:
        release(placements)


@pytest.mark.parametrize(("gpus", "count", "layouts"), [
    (8, 2, [ParallelConfig(dp_size=16, ep_size=16), ParallelConfig(tp_size=4, dp_size=4, ep_size=16)]),
    (4, 3, [ParallelConfig(tp_size=2, dp_size=6, ep_size=12)]),
])
def test_node_ordered_placement_on_temporary_nodes(ray_cluster, temporary_nodes, gpus, count, layouts):
    """Nodes of 8 and of 4 GPUs beside the session's nodes of 2: the cluster's own plan is refused (GPU nodes of
    two sizes), a plan of the temporary nodes is placed on them node by node."""
    with temporary_nodes(num_gpus=gpus, count=count) as node_ids:
        with pytest.raises(PlacementError, match="same whole number of GPUs"):
            place_ranks(layouts[0], use_gpu=True, cpus_per_rank=CPUS_PER_RANK, timeout_s=60)
        for cfg in layouts:
            plan = plan_gpu_ranks(dict.fromkeys(node_ids, float(gpus)), cfg, nvlink_domain("deepep", cfg.ep_size)
                                  if gpus == 8 else 1)
            placements = place_ranks(cfg, use_gpu=True, cpus_per_rank=CPUS_PER_RANK, timeout_s=60, plan=plan)
            try:
                check_node_ordered(cfg, plan, placements, node_ids)
            finally:
                release(placements)
