"""Stage executor, TBO schedules, SBO row parts and the latency-injection wrapper (no model, no processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.comm.all_to_all import part_counts, part_row_index
from raymoe.comm.latency import LatencyInjectedAllToAll
from raymoe.overlap.operations import (
    ForwardState,
    YieldOperation,
    execute_operations,
    execute_overlapped_operations,
    split_into_stages,
)
from raymoe.overlap.strategy import OperationsStrategy
from raymoe.step.forward_mode import ForwardMode

MOE_OPS = ["op_gate", "op_select_experts", "op_dispatch_a", "op_dispatch_b", "op_experts", "op_combine_a",
           "op_combine_b", "op_output"]


class _Recorder:
    """Object whose ``op_*`` methods log (child, layer, op name) into ``state.log``."""

    def __init__(self, layer_id: int, names: list[str]):
        self.layer_id = layer_id
        for name in names:
            setattr(self, name, self._make(name))

    def _make(self, name):
        def op(state):
            state.log.append((state.name, self.layer_id, name))
        op.__name__ = name
        return op


class _FakeLayer:
    def __init__(self, layer_id: int, is_moe: bool):
        self.is_moe = is_moe
        self.own = _Recorder(layer_id, ["op_comm_prepare_attn", "op_comm_prepare_mlp", "op_dense_mlp",
                                        "op_comm_postprocess_layer"])
        self.self_attn = _Recorder(layer_id, ["op_prepare", "op_core"])
        self.mlp = _Recorder(layer_id, MOE_OPS)

    def operations(self):
        mlp = [getattr(self.mlp, n) for n in MOE_OPS] if self.is_moe else [self.own.op_dense_mlp]
        return [self.own.op_comm_prepare_attn, self.self_attn.op_prepare, self.self_attn.op_core,
                self.own.op_comm_prepare_mlp, *mlp, self.own.op_comm_postprocess_layer]


def _run(layers, mode):
    strategy = OperationsStrategy.tbo(layers, mode)
    log: list = []
    states = [ForwardState(name=n, log=log) for n in "AB"]
    execute_overlapped_operations(states, [strategy.operations] * 2, [0, strategy.tbo_delta_stages])
    return strategy, log


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.IDLE])
def test_tbo_schedule_keeps_op_order_and_overlaps_transfers(mode):
    layers = [_FakeLayer(0, True), _FakeLayer(1, False), _FakeLayer(2, True), _FakeLayer(3, True)]
    strategy, log = _run(layers, mode)
    assert strategy.tbo_delta_stages == (0 if mode == ForwardMode.EXTEND else 2)
    plain_log: list = []
    execute_operations(ForwardState(name="A", log=plain_log), OperationsStrategy.plain(layers).operations)
    for child in "AB":  # each child runs exactly the plain op sequence
        assert [e[1:] for e in log if e[0] == child] == [e[1:] for e in plain_log]
    # Every transfer except child B's very last combine has the other child's work while it is in flight.
    pairs = [("op_dispatch_a", "op_dispatch_b"), ("op_combine_a", "op_combine_b")]
    last_moe = max(i for i, layer in enumerate(layers) if layer.is_moe)
    for child, other in (("A", "B"), ("B", "A")):
        for layer_id, layer in enumerate(layers):
            if not layer.is_moe:
                continue
            for start_op, end_op in pairs:
                i = log.index((child, layer_id, start_op))
                j = log.index((child, layer_id, end_op))
                overlapped = any(e[0] == other for e in log[i + 1:j])
                tail = child == "B" and layer_id == last_moe and start_op == "op_combine_a"
                assert overlapped or (tail and mode != ForwardMode.EXTEND), (mode, child, layer_id, start_op)


def test_schedules_of_all_ranks_agree_on_collective_order():
    layers = [_FakeLayer(i, True) for i in range(3)]
    comm = {"op_dispatch_a", "op_combine_a"}
    orders = {m: [(c, lid, n) for c, lid, n in _run(layers, m)[1] if n in comm] for m in ForwardMode
              if m != ForwardMode.MIXED}
    assert orders[ForwardMode.IDLE] == orders[ForwardMode.DECODE]  # an IDLE rank pairs with DECODE ranks
    assert orders[ForwardMode.EXTEND] != orders[ForwardMode.DECODE]  # hence the driver never mixes them
    with pytest.raises(ValueError):
        OperationsStrategy.tbo(layers, ForwardMode.MIXED)


def test_stage_splitting_and_executor_errors():
    y = YieldOperation()

    def f(s):
        return None

    assert split_into_stages([y, f, y, y, f, f, y]) == [[f], [f, f]]
    with pytest.raises(ValueError):
        execute_overlapped_operations([ForwardState(), ForwardState()], [[f], [f, y, f]], [0, 1])
    with pytest.raises(ValueError):
        execute_overlapped_operations([ForwardState(), ForwardState()], [[f], [f]], [1, 0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(1, 4))
def test_sbo_parts_partition_every_peer_chunk(counts, num_parts):
    rows = [part_row_index(counts, p, num_parts).tolist() for p in range(num_parts)]
    assert sorted(r for part in rows for r in part) == list(range(sum(counts)))
    for p, part in enumerate(rows):
        assert len(part) == sum(part_counts(counts, p, num_parts)) and part == sorted(part)


class _FakeA2A:
    ep_size = 2

    def dispatch_a(self, hidden, topk_ids):
        return object()

    def dispatch_b(self, handle):
        return "dispatched"

    def combine_a(self, handle, out, part=0, num_parts=1):
        self.parts = (part, num_parts)

    def combine_b(self, handle):
        return "combined"


def test_latency_wrapper_waits_only_for_the_remaining_latency():
    now = [0.0]
    slept: list[float] = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    a2a = LatencyInjectedAllToAll(_FakeA2A(), 0.002, clock=lambda: now[0], sleep=sleep)
    assert a2a.ep_size == 2
    h = a2a.dispatch_a(torch.zeros(1, 1), torch.zeros(1, 1))
    now[0] += 0.0005  # compute between _a and _b hides part of the latency
    assert a2a.dispatch_b(h) == "dispatched"
    assert slept == [pytest.approx(0.0015)]
    a2a.combine_a(h, torch.zeros(1, 1), part=1, num_parts=2)
    assert a2a.inner.parts == (1, 2)
    now[0] += 0.005  # more compute than latency: no wait at all
    assert a2a.combine_b(h) == "combined"
    assert len(slept) == 1
    with pytest.raises(ValueError):
        LatencyInjectedAllToAll(_FakeA2A(), -1.0)
