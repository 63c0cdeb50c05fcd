"""The node-ordered plan of GPU worlds (``raymoe.cluster.rank_plan``), on node inventories alone: rank r on node
r // G as local rank r % G, TP groups inside a node, DeepEP's NVLink domains inside a node, the CUDA device each
rank takes, and clear errors where a cluster does not admit the plan."""

from __future__ import annotations

import pytest

from raymoe.cluster.rank_plan import (
    RankDevice,
    RankPlan,
    RankSlot,
    check_placed,
    nvlink_domain,
    plan_gpu_ranks,
    rank_cuda_devices,
)
from raymoe.cluster.topology import tp_group_ranks
from raymoe.config import ParallelConfig
from raymoe.errors import PlacementError


def nodes(count: int, gpus: int) -> dict[str, float]:
    """An inventory as Ray reports it: node id -> declared GPUs (floats)."""
    return {f"{i:02d}" + "ab" * 27: float(gpus) for i in range(count)}


def plan_nodes(plan: RankPlan) -> list[int]:
    return [s.node for s in plan.slots]


def where(plan: RankPlan) -> list[tuple[int, int]]:
    return [(s.node, s.local_rank) for s in plan.slots]


def test_two_nodes_of_eight_dp16_ep16_put_each_deepep_nvlink_domain_on_one_node():
    cfg = ParallelConfig(dp_size=16, ep_size=16)
    plan = plan_gpu_ranks(nodes(2, 8), cfg, nvlink_domain("deepep", 16))
    assert plan.gpus_per_node == 8 and plan.num_nodes == 2
    assert where(plan) == [(0, r) for r in range(8)] + [(1, r) for r in range(8)]
    assert plan.node_ranks(0) == list(range(8)) and plan.node_ranks(1) == list(range(8, 16))
    # DeepEP: rdma_rank = rank // 8 is the node, nvl_rank = rank % 8 the GPU on it
    assert all((s.node, s.local_rank) == divmod(s.rank, 8) for s in plan.slots)
    # Ray hands bundle b of a fresh node GPU b (tests/test_gpu_placement.py): rank r computes on cuda:(r % 8)
    devices = rank_cuda_devices(plan_nodes(plan), [[r % 8] for r in range(16)])
    assert devices == [RankDevice("0,1,2,3,4,5,6,7", r % 8) for r in range(16)]


def test_two_nodes_of_eight_dp4_tp4_pack_tp_groups_and_spread_dp_groups():
    cfg = ParallelConfig(tp_size=4, dp_size=4, ep_size=16)
    plan = plan_gpu_ranks(nodes(2, 8), cfg)
    tp_nodes = [{plan.slots[r].node for r in group} for group in tp_group_ranks(cfg)]
    assert tp_nodes == [{0}, {0}, {1}, {1}]  # every TP group inside a node, DP groups in node order
    assert [plan.slots[r].local_rank for r in tp_group_ranks(cfg)[3]] == [4, 5, 6, 7]


def test_three_nodes_of_four():
    plan = plan_gpu_ranks(nodes(3, 4), ParallelConfig(tp_size=2, dp_size=6, ep_size=12))
    assert where(plan) == [(r // 4, r % 4) for r in range(12)] and plan.num_nodes == 3
    assert [{plan.slots[r].node for r in g} for g in tp_group_ranks(ParallelConfig(tp_size=2, dp_size=6,
                                                                                       ep_size=12))] == \
        [{0}, {0}, {1}, {1}, {2}, {2}]
    # DeepEP at ep <= 4 stays inside one node; at ep = 12 its NVLink domain of ranks 0-7 would span two nodes
    assert plan_gpu_ranks(nodes(3, 4), ParallelConfig(dp_size=4, ep_size=4), nvlink_domain("deepep", 4)).num_nodes == 1
    with pytest.raises(PlacementError, match="ranks 0-7 as the GPUs of one node.*on 2 nodes"):
        plan_gpu_ranks(nodes(3, 4), ParallelConfig(dp_size=12, ep_size=12), nvlink_domain("deepep", 12))


def test_small_and_uneven_worlds_fill_nodes_in_order():
    assert where(plan_gpu_ranks(nodes(2, 8), ParallelConfig(tp_size=2, dp_size=2))) == [(0, 0), (0, 1), (0, 2),
                                                                                          (0, 3)]
    plan = plan_gpu_ranks(nodes(2, 8), ParallelConfig(dp_size=12, ep_size=12))
    assert plan.num_nodes == 2 and plan.node_ranks(1) == [8, 9, 10, 11]


def test_clusters_that_do_not_admit_the_plan_are_clear_errors():
    mixed = {**nodes(1, 8), "ff" * 28: 4.0}
    with pytest.raises(PlacementError, match=r"same whole number of GPUs.*4\.0.*8\.0"):
        plan_gpu_ranks(mixed, ParallelConfig(dp_size=2, ep_size=2))
    with pytest.raises(PlacementError, match="same whole number"):
        plan_gpu_ranks({"aa" * 28: 0.5}, ParallelConfig())
    with pytest.raises(PlacementError, match="no node of the cluster declares a GPU"):
        plan_gpu_ranks({}, ParallelConfig(dp_size=2, ep_size=2))
    for tp in (3, 16):
        with pytest.raises(PlacementError, match=f"tp_size {tp} does not divide the 8 GPUs"):
            plan_gpu_ranks(nodes(2, 8), ParallelConfig(tp_size=tp))


def test_nvlink_domain_is_deepeps_only():
    assert [nvlink_domain("deepep", ep) for ep in (1, 2, 4, 8, 16, 64)] == [1, 2, 4, 8, 8, 8]
    assert nvlink_domain("torch", 16) == 1


def test_check_placed_refuses_a_placement_that_breaks_the_plan():
    plan = plan_gpu_ranks(nodes(2, 2), ParallelConfig(dp_size=4, ep_size=4))
    check_placed(plan, ["a", "a", "b", "b"])
    for bad in (["a", "b", "b", "b"], ["a", "a", "a", "a"], ["a", "a", "b"]):
        with pytest.raises(PlacementError):
            check_placed(plan, bad)


def test_cuda_devices_list_the_nodes_gpus_in_local_rank_order():
    plan = plan_gpu_ranks(nodes(2, 2), ParallelConfig(dp_size=4, ep_size=4))
    # Ray's ids need not follow bundle order (another engine holds GPUs 0-1 of the second node)
    devices = rank_cuda_devices(plan_nodes(plan), [[1], [0], ["3"], ["2"]])
    assert devices == [RankDevice("1,0", 0), RankDevice("1,0", 1), RankDevice("3,2", 0), RankDevice("3,2", 1)]
    # every rank computes on the GPU Ray reserved for it
    assert [d.visible_devices.split(",")[d.device_index] for d in devices] == ["1", "0", "3", "2"]
    with pytest.raises(PlacementError, match="exactly one"):
        rank_cuda_devices(plan_nodes(plan), [[0, 1], [0], [1], [2]])
    with pytest.raises(PlacementError, match="one GPU each"):
        rank_cuda_devices(plan_nodes(plan), [[0], [0], [1], [2]])
    with pytest.raises(PlacementError, match="GPU ids of 3 ranks for 4"):
        rank_cuda_devices(plan_nodes(plan), [[0], [1], [2]])
    # placed node ids in any order: a rank's index is its position among its node's ranks, in rank order
    assert rank_cuda_devices(["n1", "n2", "n1", "n2"], [[5], [0], [4], [1]]) == [
        RankDevice("5,4", 0), RankDevice("0,1", 0), RankDevice("5,4", 1), RankDevice("0,1", 1)]


def test_plan_record_refuses_slots_off_the_rule():
    RankPlan(2, (RankSlot(0, 0, 0), RankSlot(1, 0, 1), RankSlot(2, 1, 0)))
    with pytest.raises(ValueError, match="rank r on node r // 2"):
        RankPlan(2, (RankSlot(0, 0, 0), RankSlot(1, 1, 0)))
