"""Tests of fault-aware expert placement (``raymoe.eplb.fault_spread``, ``rebalance_experts(num_fault_domains=)``):
every expert keeps replicas on two DP groups, so ``plan_shrink`` succeeds for the loss of any one group; load-only
placement fails that on the same load; balance stays close to the load-only placement; the controller's rebalance
keeps it; bad arguments are refused."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.actors.elastic_plan import CannotShrink, fault_tolerant, plan_shrink
from raymoe.config import ParallelConfig
from raymoe.eplb.controller import EplbController
from raymoe.eplb.fault_spread import can_spread, spread_row
from raymoe.eplb.location import ExpertLocation
from raymoe.eplb.placement import rank_balance, rebalance_experts, replica_count


def location(physical_to_logical: torch.Tensor, num_logical: int) -> ExpertLocation:
    return ExpertLocation(num_logical, tuple(tuple(row) for row in physical_to_logical.tolist()))


@st.composite
def problems(draw):
    tp = draw(st.integers(1, 2))
    dp = draw(st.integers(2, 4))
    num_ranks = tp * dp
    num_groups = draw(st.sampled_from([1, 2]))
    num_logical = num_groups * draw(st.integers(1, 5))
    num_physical = num_ranks * (-(-2 * num_logical // num_ranks) + draw(st.integers(0, 2)))  # P >= 2E
    num_nodes = draw(st.sampled_from([n for n in (1, 2) if num_ranks % n == 0]))
    loads = st.lists(st.integers(0, 10_000) | st.sampled_from([0, 1]), min_size=num_logical, max_size=num_logical)
    weight = torch.tensor(draw(st.lists(loads, min_size=1, max_size=3)))
    return weight, num_physical, num_groups, num_nodes, tp, dp


@settings(max_examples=200, deadline=None)
@given(problems())
def test_every_expert_survives_the_loss_of_any_one_dp_group(problem):
    weight, num_physical, num_groups, num_nodes, tp, dp = problem
    num_ranks = tp * dp
    p2l, counts = rebalance_experts(weight, num_physical, num_groups, num_nodes, num_ranks, num_fault_domains=dp)
    assert p2l.shape == (weight.size(0), num_physical)
    assert torch.equal(counts, replica_count(p2l, weight.size(1))) and bool((counts >= 2).all())
    parallel = ParallelConfig(tp_size=tp, dp_size=dp, ep_size=num_ranks)
    loc = location(p2l, weight.size(1))
    assert fault_tolerant(parallel, loc)
    for group in range(dp):  # a whole group lost, not only one of its ranks
        plan = plan_shrink(parallel, loc, range(group * tp, (group + 1) * tp))
        assert plan.parallel.dp_size == dp - 1
    again, _ = rebalance_experts(weight.clone(), num_physical, num_groups, num_nodes, num_ranks,
                                 num_fault_domains=dp)
    assert torch.equal(again, p2l)  # deterministic


def test_load_only_placement_leaves_cold_experts_on_one_rank_where_spreading_does_not():
    # 4 experts, 8 slots, 2 ranks (dp=2, tp=1): expert 0 takes nearly all the load, so the load-only placement
    # gives it most slots and two cold experts one each; losing the rank that holds one leaves it unserved.
    weight = torch.tensor([[10_000, 10, 10, 10]])
    parallel = ParallelConfig(dp_size=2, ep_size=2)
    p2l, counts = rebalance_experts(weight, 8, 1, 1, 2)
    assert counts.tolist() == [[4, 2, 1, 1]]
    assert not fault_tolerant(parallel, location(p2l, 4))
    with pytest.raises(CannotShrink, match="MoE layer 0"):
        for rank in range(2):
            plan_shrink(parallel, location(p2l, 4), [rank])
    spread, spread_counts = rebalance_experts(weight, 8, 1, 1, 2, num_fault_domains=2)
    assert spread_counts.tolist() == [[2, 2, 2, 2]]
    assert fault_tolerant(parallel, location(spread, 4))
    # two replicas each, split evenly: both ranks carry half of every expert
    assert rank_balance(weight, spread, 2).tolist() == [1.0]


def test_spreading_costs_little_balance_on_skewed_loads():
    num_logical, num_ranks = 16, 8
    gen = torch.Generator().manual_seed(0)
    weight = (1000.0 / torch.arange(1, num_logical + 1, dtype=torch.float64))[torch.randperm(num_logical,
                                                                                            generator=gen)]
    weight = weight.repeat(3, 1)
    alone, _ = rebalance_experts(weight, 40, 1, 1, num_ranks)
    spread, _ = rebalance_experts(weight, 40, 1, 1, num_ranks, num_fault_domains=num_ranks)
    assert fault_tolerant(ParallelConfig(dp_size=num_ranks, ep_size=num_ranks), location(spread, num_logical))
    assert not fault_tolerant(ParallelConfig(dp_size=num_ranks, ep_size=num_ranks), location(alone, num_logical))
    lost = rank_balance(weight, alone, num_ranks) - rank_balance(weight, spread, num_ranks)
    assert float(lost.max()) < 0.1, lost  # printed figures: pytest -s
    print("balance load-only", rank_balance(weight, alone, num_ranks).tolist(), "spread",
          rank_balance(weight, spread, num_ranks).tolist())


def test_spread_row_swaps_one_slot_per_expert_on_one_domain():
    # 2 domains of 1 rank x 4 slots; experts 0 and 1 both live only on rank 0, experts 2 and 3 only on rank 1
    row = [0, 0, 1, 1, 2, 2, 3, 3]
    out = spread_row(row, [4.0, 3.0, 2.0, 1.0], num_ranks=2, num_fault_domains=2)
    assert sorted(out) == sorted(row) and sorted(out[:4]) != sorted(row[:4])
    for expert in range(4):
        assert {slot // 4 for slot, e in enumerate(out) if e == expert} == {0, 1}
    assert spread_row(out, [4.0, 3.0, 2.0, 1.0], 2, 2) == out  # already spread: unchanged


@pytest.mark.parametrize("fault_domain_ranks", [0, 1])
def test_controller_rebalance_keeps_the_placement_fault_tolerant(fault_domain_ranks):
    num_logical, ep = 4, 2
    initial = ExpertLocation.trivial(2, num_logical, 12)  # each expert 3 slots, on both ranks
    controller = EplbController(initial, ep, enable_eplb=True, record_interval=10**6, window_steps=10**7,
                                rebalance_every=10**6, min_window_tokens=1, experts_per_step=8,
                                fault_domain_ranks=fault_domain_ranks)
    controller.record([[10_000, 10, 10, 10, 10, 10_000, 10, 10]])  # one group's counters, [L * E] flat
    controller.request_rebalance()
    controller.next_update()
    for _ in range(100):  # the move's chunks and commits, one per step
        if not controller.moving:
            break
        controller.next_update()
    assert controller.num_rebalances == 1 and controller.location != initial
    # load alone gives the cold experts one slot each; with the domains every expert keeps one on each rank
    assert fault_tolerant(ParallelConfig(dp_size=2, ep_size=2), controller.location) == bool(fault_domain_ranks)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: rebalance_experts(torch.ones(1, 4), 8, 1, 1, 2, num_fault_domains=0), "num_fault_domains"),
    (lambda: rebalance_experts(torch.ones(1, 4), 9, 1, 1, 3, num_fault_domains=2), "num_fault_domains"),
    (lambda: spread_row([0, 1, 1, 1], [1.0, 1.0], 2, 2), "expert 0 holds 1 slots"),
    (lambda: spread_row([0, 0, 1, 1], [1.0, 1.0], 3, 1), "num_ranks"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_can_spread_needs_two_slots_per_expert_and_two_domains():
    assert can_spread(4, 8, 2) and not can_spread(4, 7, 2) and not can_spread(4, 8, 1)


def test_a_start_placement_from_a_load_record_is_spread_with_elastic_ep(tmp_path):
    from raymoe.actors.factory import _fault_domains
    from raymoe.config import EngineConfig, FaultConfig
    from raymoe.eplb.initial import initial_expert_location

    record = tmp_path / "load.json"
    record.write_text(json.dumps({"expert_load": [[10_000, 10, 10, 10]]}))
    parallel = ParallelConfig(dp_size=2, ep_size=2)
    for elastic in (True, False):
        config = EngineConfig(model="m", parallel=parallel, faults=FaultConfig(elastic_ep=elastic))
        domains = _fault_domains(config)
        assert domains == (2 if elastic else 1)
        loc = initial_expert_location(1, 4, 2, 4, str(record), num_fault_domains=domains)
        assert fault_tolerant(parallel, loc) == elastic
