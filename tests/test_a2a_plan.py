"""Property tests of the driver's all-to-all plan (``raymoe.comm.a2a_plan``): one mode and one low-latency
capacity for every rank, the least capacity that holds every group, and the TBO children's share of it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_overlap_split import worker_batch

from raymoe.comm.a2a_plan import apply_dispatch_plan, child_dispatch_capacity, plan_dispatch_capacity
from raymoe.runner.graph_buckets import apply_graph_plan
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.worker_batch import ModelWorkerBatch

MODES = [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.IDLE]


def group(mode: ForwardMode, tokens: int) -> ModelWorkerBatch:
    """One DP group's batch with ``tokens`` tokens (IDLE: none; EXTEND: one sequence; DECODE/MIXED: one each)."""
    if mode == ForwardMode.IDLE:
        return ModelWorkerBatch.idle()
    return worker_batch(mode, [tokens] if mode == ForwardMode.EXTEND else [1] * tokens)


groups = st.lists(st.one_of(st.just((ForwardMode.IDLE, 0)),
                            st.tuples(st.sampled_from(MODES[:3]), st.integers(1, 40))), min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(groups, st.sampled_from(["auto", "normal", "low_latency"]), st.integers(1, 48),
       st.lists(st.integers(1, 64), max_size=4))
def test_dispatch_plan_is_the_least_capacity_for_every_rank(specs, a2a_mode, bound, sizes):
    batches = apply_graph_plan([group(m, n) for m, n in specs], sorted(set(sizes)))  # the driver's order
    out = apply_dispatch_plan(batches, a2a_mode, bound)
    (cap,) = {b.dispatch_capacity for b in out}  # one answer for every rank
    assert cap == plan_dispatch_capacity(batches, a2a_mode, bound)
    for before, after in zip(batches, out, strict=True):
        assert dataclasses.replace(after, dispatch_capacity=None) == before  # nothing else changes
        assert (after is before) == (cap is None)
    decode_step = all(m in (ForwardMode.DECODE, ForwardMode.IDLE) for m, _ in specs)
    tokens = max(n for _, n in specs)
    graph_bs = batches[0].graph_bs
    if a2a_mode == "normal" or (a2a_mode == "auto" and not decode_step):
        assert cap is None
    elif graph_bs is not None:
        assert cap == graph_bs  # the graphs were captured with the bucket as their capacity
    elif tokens > bound:
        assert cap is None  # past DeepEP's buffer bound: normal mode
    else:
        assert cap == max(tokens, 1)


def test_dispatch_plan_examples():
    idle = [group(ForwardMode.IDLE, 0)] * 2
    assert plan_dispatch_capacity(idle, "low_latency", 8) == 1  # an all-IDLE step still exchanges one row
    at_bound = [group(ForwardMode.DECODE, 8), group(ForwardMode.DECODE, 3)]
    assert plan_dispatch_capacity(at_bound, "auto", 8) == 8  # exactly the bound still fits
    assert plan_dispatch_capacity(at_bound, "auto", 7) is None


def test_groups_that_disagree_on_the_graph_bucket_are_refused():
    decode, idle = group(ForwardMode.DECODE, 5), group(ForwardMode.IDLE, 0)
    for batches in ([dataclasses.replace(decode, graph_bs=8), idle], [idle, dataclasses.replace(decode, graph_bs=8)],
                    [dataclasses.replace(decode, graph_bs=8), dataclasses.replace(idle, graph_bs=16)]):
        with pytest.raises(ValueError, match="disagree on the graph bucket"):
            plan_dispatch_capacity(batches, "auto", 64)
        with pytest.raises(ValueError, match="disagree on the graph bucket"):
            apply_dispatch_plan(batches, "normal", 64)
    agreed = apply_graph_plan([decode, idle], [4, 8])
    assert [b.graph_bs for b in agreed] == [8, 8] and plan_dispatch_capacity(agreed, "auto", 4) == 8


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4096), st.sampled_from(MODES))
def test_child_capacity_is_the_least_that_holds_either_half(capacity, mode):
    child = child_dispatch_capacity(capacity, mode)
    assert child_dispatch_capacity(None, mode) is None
    if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
        assert type(child) is int and child == -(-capacity // 2)  # ceil(M / 2)
        # a DECODE batch of bs <= M rows splits at bs // 2: either half fits, and the fullest batch needs all of it
        assert all(bs - bs // 2 <= child for bs in range(capacity + 1))
        assert capacity - capacity // 2 == child
    else:
        assert child == capacity  # an EXTEND split can be uneven
