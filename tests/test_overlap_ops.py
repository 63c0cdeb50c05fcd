"""Stage executor, TBO schedules, SBO row parts and the latency-injection wrapper (no model, no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.comm.all_to_all import part_counts, part_row_index
from raymoe.comm.latency import LatencyInjectedAllToAll
from raymoe.config import OverlapConfig
from raymoe.errors import InvalidRequestError
from raymoe.overlap.operations import (
    ForwardState,
    OpRole,
    YieldOperation,
    execute_operations,
    execute_overlapped_operations,
    split_into_stages,
    stage_op,
)
from raymoe.overlap.strategy import KVLayerMark, OperationsStrategy, resolve_decode_schedule
from raymoe.platform.selector import select_platform
from raymoe.step.forward_mode import ForwardMode

MOE_OPS = ["op_gate", "op_select_experts", "op_dispatch_a", "op_dispatch_b", "op_experts", "op_combine_a",
           "op_combine_b", "op_output"]
ROLES = {"op_core": OpRole.ATTN_CORE, "op_dispatch_a": OpRole.DISPATCH_A, "op_dispatch_b": OpRole.DISPATCH_B,
         "op_experts": OpRole.EXPERTS, "op_combine_a": OpRole.COMBINE_A, "op_combine_b": OpRole.COMBINE_B,
         "op_shared_experts": OpRole.SHARED_EXPERTS, "op_output": OpRole.OUTPUT}


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
        return stage_op(ROLES[name])(op) if name in ROLES else op


class _FakeLayer:
    def __init__(self, layer_id: int, is_moe: bool, shared: bool = False):
        self.is_moe = is_moe
        self.layer_id = layer_id
        self.own = _Recorder(layer_id, ["op_comm_prepare_attn", "op_comm_prepare_mlp", "op_dense_mlp",
                                        "op_comm_postprocess_layer"])
        self.self_attn = _Recorder(layer_id, ["op_prepare", "op_core"])
        # DeepSeek-like blocks list their shared experts right after the dispatch start.
        self.moe_ops = MOE_OPS[:3] + ["op_shared_experts"] + MOE_OPS[3:] if shared else MOE_OPS
        self.mlp = _Recorder(layer_id, self.moe_ops)

    def operations(self):
        mlp = [getattr(self.mlp, n) for n in self.moe_ops] if self.is_moe else [self.own.op_dense_mlp]
        return [self.own.op_comm_prepare_attn, self.self_attn.op_prepare, self.self_attn.op_core,
                self.own.op_comm_prepare_mlp, *mlp, self.own.op_comm_postprocess_layer]


NO_STREAM = SimpleNamespace(kv_stream=None)  # the ForwardBatch field the layers' KVLayerMark ops read


def _run(layers, mode, decode_schedule="fine"):
    strategy = OperationsStrategy.tbo(layers, mode, decode_schedule)
    log: list = []
    states = [SimpleNamespace(name=n, log=log, forward_batch=NO_STREAM) for n in "AB"]
    execute_overlapped_operations(states, [strategy.operations] * 2, [0, strategy.tbo_delta_stages])
    return strategy, log


@pytest.mark.parametrize("decode_schedule", ["fine", "coarse"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.IDLE])
def test_tbo_schedule_keeps_op_order_and_overlaps_transfers(mode, decode_schedule):
    layers = [_FakeLayer(0, True), _FakeLayer(1, False), _FakeLayer(2, True), _FakeLayer(3, True)]
    strategy, log = _run(layers, mode, decode_schedule)
    coarse = mode == ForwardMode.EXTEND or decode_schedule == "coarse"
    assert strategy.tbo_delta_stages == (0 if coarse else 2)
    plain_log: list = []
    execute_operations(SimpleNamespace(name="A", log=plain_log, forward_batch=NO_STREAM),
                       OperationsStrategy.plain(layers).operations)
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
                assert overlapped or (tail and not coarse), (mode, child, layer_id, start_op)


def test_coarse_decode_schedule_is_the_prefill_schedule_and_auto_follows_the_device():
    """``coarse`` DECODE (and IDLE, which must match it) steps use the EXTEND stages; ``auto`` means coarse on
    CPU and SGLang's fine schedule on CUDA; unknown names are refused."""
    layer = _FakeLayer(0, True, shared=True)
    prefill = _stage_names(layer, ForwardMode.EXTEND)
    for mode in (ForwardMode.DECODE, ForwardMode.IDLE):
        assert _stage_names(layer, mode, "coarse") == prefill
        assert _stage_names(layer, mode, "fine") != prefill
    cpu, cuda = (p.default_tbo_decode_schedule for p in (select_platform("cpu"), select_platform("cuda")))
    assert resolve_decode_schedule("auto", cpu) == "coarse" and resolve_decode_schedule("auto", cuda) == "fine"
    assert resolve_decode_schedule("fine", cpu) == "fine"
    with pytest.raises(ValueError, match="schedule"):
        resolve_decode_schedule("wide", cpu)
    with pytest.raises(ValueError, match="schedule"):
        OperationsStrategy.tbo([layer], ForwardMode.DECODE, "auto")
    with pytest.raises(InvalidRequestError, match="tbo_decode_schedule"):
        OverlapConfig(tbo_decode_schedule="wide")


def _stage_names(layer, mode, decode_schedule="fine") -> list[list[str]]:
    strategy = OperationsStrategy.tbo([layer], mode, decode_schedule)
    return [[op.__name__ for op in stage if not isinstance(op, KVLayerMark)]
            for stage in split_into_stages(strategy.operations)]


def test_every_op_list_ends_each_layer_with_its_kv_mark():
    """Plain, single-batch and two-batch overlap lists: layer i's last op is ``KVLayerMark(i)`` (a PD prefill
    rank writes layer i's KV once every half of the step has passed it; ``raymoe.kvcache.kv_stream``), and a
    mark does nothing on a step without a stream."""
    layers = [_FakeLayer(0, True), _FakeLayer(1, False), _FakeLayer(2, True)]
    for strategy in (OperationsStrategy.plain(layers), OperationsStrategy.tbo(layers, ForwardMode.EXTEND),
                     OperationsStrategy.tbo(layers, ForwardMode.DECODE)):
        marks = [(i, op.layer) for i, op in enumerate(strategy.operations) if isinstance(op, KVLayerMark)]
        assert [layer for _, layer in marks] == [0, 1, 2]
        assert marks[-1][0] == len(strategy.operations) - 1
        seen: list[int] = []
        state = SimpleNamespace(forward_batch=SimpleNamespace(kv_stream=SimpleNamespace(layer_done=(
            lambda layer, fb, seen=seen: seen.append(layer)))))
        for i, _ in marks:
            strategy.operations[i](state)
        assert seen == [0, 1, 2]
        strategy.operations[marks[0][0]](SimpleNamespace(forward_batch=SimpleNamespace(kv_stream=None)))


def test_deepseek_schedules_place_shared_experts_per_mode():
    """Decode: shared experts in the dispatch stage; prefill: after the combine start, before its wait (SGLang's
    DeepSeek schedules). Dense layers (DeepSeek's first layers) add no stage."""
    layer = _FakeLayer(0, True, shared=True)
    assert _stage_names(layer, ForwardMode.DECODE) == [
        ["op_comm_prepare_attn", "op_prepare"], ["op_core", "op_comm_prepare_mlp", "op_gate", "op_select_experts"],
        ["op_dispatch_a", "op_shared_experts"], ["op_dispatch_b", "op_experts", "op_combine_a"], ["op_combine_b"],
        ["op_output", "op_comm_postprocess_layer"]]
    assert _stage_names(layer, ForwardMode.EXTEND) == [
        ["op_comm_prepare_attn", "op_prepare", "op_core", "op_comm_prepare_mlp", "op_gate", "op_select_experts",
         "op_dispatch_a"], ["op_dispatch_b", "op_experts", "op_combine_a"],
        ["op_shared_experts", "op_combine_b", "op_output", "op_comm_postprocess_layer"]]
    mixed = [_FakeLayer(0, False), _FakeLayer(1, True, shared=True), _FakeLayer(2, True, shared=True)]
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND):
        strategy, log = _run(mixed, mode)
        per_moe = len(split_into_stages(OperationsStrategy.tbo(mixed[1:2], mode).operations))
        assert len(split_into_stages(strategy.operations)) == 2 * per_moe - 1  # the dense layer adds no stage
        assert sum(1 for e in log if e[2] == "op_shared_experts") == 4


def test_stage_boundaries_follow_op_marks_not_names():
    layer = _FakeLayer(0, True, shared=True)
    before = {m: _stage_names(layer, m) for m in (ForwardMode.DECODE, ForwardMode.EXTEND)}
    for name in ("op_dispatch_b", "op_combine_b", "op_shared_experts"):  # rename ops: the stages stay the same
        getattr(layer.mlp, name).__name__ = "renamed_" + name
    for mode, stages in before.items():
        assert [len(s) for s in _stage_names(layer, mode)] == [len(s) for s in stages]
    unmarked = _FakeLayer(1, True)
    plain_op = unmarked.mlp.op_combine_b

    def op_combine_b(state):  # same name, no mark: refused instead of silently merging two stages
        plain_op(state)
    unmarked.mlp.op_combine_b = op_combine_b
    with pytest.raises(ValueError, match="COMBINE_B"):
        OperationsStrategy.tbo([unmarked], ForwardMode.DECODE)


def test_forward_state_declares_its_fields():
    state = ForwardState(hidden_states=torch.zeros(2, 4))
    state.shared_output = torch.ones(2, 4)
    with pytest.raises(AttributeError):
        state.shared_outptu = torch.ones(2, 4)  # a typo is an error, not a new attribute


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
        execute_overlapped_operations([SimpleNamespace(), SimpleNamespace()], [[f], [f, y, f]], [0, 1])
    with pytest.raises(ValueError):
        execute_overlapped_operations([SimpleNamespace(), SimpleNamespace()], [[f], [f]], [1, 0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=4), st.integers(1, 4))
def test_sbo_parts_partition_every_peer_chunk(counts, num_parts):
    rows = [part_row_index(counts, p, num_parts).tolist() for p in range(num_parts)]
    assert sorted(r for part in rows for r in part) == list(range(sum(counts)))
    for p, part in enumerate(rows):
        assert len(part) == sum(part_counts(counts, p, num_parts)) and part == sorted(part)


class _FakeA2A:
    ep_size = 2

    def dispatch_a(self, hidden, topk_ids, topk_weights, capacity=None):
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
    h = a2a.dispatch_a(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
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
