"""Which ranks a rank group keeps serving on after a fault (``raymoe.actors.elastic_plan``): whole DP groups are
dropped, the survivors keep their slots, and a shrink is refused (by name) when some expert would have no slot."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.actors.elastic_plan import CannotShrink, fault_tolerant, plan_shrink
from raymoe.config import ParallelConfig
from raymoe.eplb.location import ExpertLocation


def test_a_lost_rank_of_dp2_ep2_leaves_the_other_with_every_expert_when_each_has_two_slots():
    location = ExpertLocation.trivial(num_layers=3, num_logical=8, num_physical=16)  # rank r: slots 8r..8r+7
    plan = plan_shrink(ParallelConfig(dp_size=2, ep_size=2), location, [1])
    assert plan.parallel == ParallelConfig(dp_size=1, ep_size=1)
    assert (plan.survivors, plan.lost_groups) == ((0,), (1,))
    assert plan.location.physical_to_logical == (tuple(range(8)),) * 3
    plan = plan_shrink(ParallelConfig(dp_size=2, ep_size=2), location, [0])
    assert plan.survivors == (1,) and plan.location.num_physical == 8
    assert fault_tolerant(ParallelConfig(dp_size=2, ep_size=2), location)


def test_too_few_replicas_or_no_surviving_group_cannot_shrink():
    parallel = ParallelConfig(dp_size=2, ep_size=2)
    two_extra = ExpertLocation.trivial(2, 8, 10)  # rank 1 holds 5..7, 0, 1: experts 2..4 live on rank 0 only
    with pytest.raises(CannotShrink, match="MoE layer 0: expert 2 has no slot"):
        plan_shrink(parallel, two_extra, [0])
    with pytest.raises(CannotShrink, match="no redundant experts"):
        plan_shrink(parallel, None, [1])
    with pytest.raises(CannotShrink, match="every DP group lost a rank"):
        plan_shrink(parallel, ExpertLocation.trivial(2, 8, 16), [0, 1])
    with pytest.raises(CannotShrink, match="no rank was lost"):
        plan_shrink(parallel, ExpertLocation.trivial(2, 8, 16), [])
    with pytest.raises(ValueError, match="outside the world"):
        plan_shrink(parallel, ExpertLocation.trivial(2, 8, 16), [2])
    assert not fault_tolerant(parallel, two_extra)
    assert not fault_tolerant(ParallelConfig(dp_size=1, ep_size=1), None)


def test_a_tp_group_is_lost_whole_and_the_survivors_are_renumbered():
    parallel = ParallelConfig(tp_size=2, dp_size=3, ep_size=6)
    location = ExpertLocation.trivial(1, 6, 12)  # two slots per rank; ranks r and r + 3 hold the same experts
    plan = plan_shrink(parallel, location, [3])  # rank 3: tp-rank 1 of DP group 1
    assert plan.parallel == ParallelConfig(tp_size=2, dp_size=2, ep_size=4)
    assert (plan.survivors, plan.lost_groups) == ((0, 1, 4, 5), (1,))
    assert plan.location.physical_to_logical == ((0, 1, 2, 3, 2, 3, 4, 5),)


def test_experts_inside_each_group_need_no_replicas():
    plan = plan_shrink(ParallelConfig(tp_size=2, dp_size=2, ep_size=1), None, [0, 1])
    assert plan.parallel == ParallelConfig(tp_size=2, dp_size=1, ep_size=1)
    assert plan.survivors == (2, 3) and plan.location is None
    assert fault_tolerant(ParallelConfig(tp_size=2, dp_size=2, ep_size=1), None)


@settings(max_examples=200, deadline=None)
@given(dp=st.integers(2, 4), per_rank=st.integers(1, 4), num_logical=st.integers(1, 6), data=st.data())
def test_a_shrink_keeps_each_survivors_slots_and_every_expert(dp, per_rank, num_logical, data):
    """Any placement, any lost set: either refused, or the survivors' slots in rank order, every expert kept."""
    parallel = ParallelConfig(dp_size=dp, ep_size=dp)
    num_physical = dp * per_rank
    if num_physical < num_logical:
        return
    rest = data.draw(st.lists(st.integers(0, num_logical - 1), min_size=num_physical - num_logical,
                              max_size=num_physical - num_logical))
    row = data.draw(st.permutations(list(range(num_logical)) + rest))
    location = ExpertLocation(num_logical, (tuple(row),))
    lost = data.draw(st.sets(st.integers(0, dp - 1), min_size=1, max_size=dp))
    survivors = [r for r in range(dp) if r not in lost]
    kept = [row[s] for r in survivors for s in range(r * per_rank, (r + 1) * per_rank)]
    if not survivors or set(kept) != set(range(num_logical)):
        with pytest.raises(CannotShrink):
            plan_shrink(parallel, location, lost)
        return
    plan = plan_shrink(parallel, location, lost)
    assert list(plan.survivors) == survivors
    assert list(plan.location.physical_to_logical[0]) == kept
    assert plan.parallel.world_size == len(survivors) == plan.location.num_physical // per_rank
