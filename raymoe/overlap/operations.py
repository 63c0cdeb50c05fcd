"""Operations: a layer's forward written as data (SGLang's op lists with yield separators).

An operation is a callable ``op(state) -> None`` that reads and writes attributes of a per-batch state object.
A :class:`YieldOperation` marks a stage boundary: the plain executor ignores it; the overlapped executor
switches to the other half-batch there, so communication started before a yield runs while the other half
computes. The per-layer op list is the single source of truth for both executors.

Stages: an op list ``[o1, o2, Y, o3, Y, o4]`` has the stages ``[o1, o2]``, ``[o3]``, ``[o4]``; a leading, trailing
or doubled yield adds no empty stage. :class:`StageExecutor` runs one state through its stages one ``next()`` at a
time; :func:`execute_overlapped_operations` interleaves two executors (the two-batch overlap schedule).

Typed state and marked ops: :class:`ForwardState` declares every field an op may read or write (a slotted
dataclass, so a misspelt field raises instead of creating a new attribute). Ops whose position matters to an overlap
schedule carry an :class:`OpRole` set by the :func:`stage_op` decorator; strategies place stage boundaries by role
(``raymoe.overlap.strategy``), so renaming an op cannot move a yield, and a MoE layer whose op list lacks a role
is refused instead of silently getting another stage structure (which could deadlock ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from raymoe.comm.trace import active_recorder
from raymoe.overlap.streams import TboStreams


class YieldOperation:
    """Stage separator (no work)."""

    def __repr__(self) -> str:
        return "Yield"


Operation = Callable[[Any], None] | YieldOperation


class OpRole(Enum):
    """What an op does, as far as overlap schedules and platform fusions care: schedules place stage boundaries
    before roles; a platform's fusion (``raymoe.overlap.fusion``) replaces a run of ops by their roles."""

    ATTN_INPUT_NORM = "attn_input_norm"  # residual kept, input RMSNorm
    ATTN_PREPARE = "attn_prepare"      # qkv projection, q/k norms, rotary
    ATTN_CORE = "attn_core"            # attention over the KV cache + output projection
    MLP_INPUT_NORM = "mlp_input_norm"  # residual add + post-attention RMSNorm
    ROUTER_GATE = "router_gate"        # router logits
    ROUTER_TOPK = "router_topk"        # top-k experts and their weights
    DISPATCH_A = "dispatch_a"          # start the MoE dispatch transfer
    DISPATCH_B = "dispatch_b"          # wait for it
    EXPERTS = "experts"                # local expert compute
    COMBINE_A = "combine_a"            # start the combine transfer
    COMBINE_B = "combine_b"            # wait for it
    SHARED_EXPERTS = "shared_experts"  # shared experts (need only the MoE input; placement is free)
    OUTPUT = "output"                  # weighted sum of the expert outputs (+ shared)


def stage_op(role: OpRole) -> Callable[[Callable], Callable]:
    """Decorator marking an op function (or method) with ``role``; bound methods expose it as ``op.op_role``."""

    def mark(fn: Callable) -> Callable:
        fn.op_role = role
        return fn

    return mark


def op_role(op: Operation) -> OpRole | None:
    """The role an op was marked with (None: unmarked, no schedule constraint)."""
    return getattr(op, "op_role", None)


def move_before(operations: Sequence[Operation], role: OpRole, anchor: OpRole) -> list[Operation]:
    """Copy of ``operations`` with the op marked ``role`` (if any) moved right before the op marked ``anchor``."""
    ops = list(operations)
    moving = [op for op in ops if op_role(op) == role]
    if not moving:
        return ops
    ops = [op for op in ops if op_role(op) != role]
    i = next(i for i, op in enumerate(ops) if op_role(op) == anchor)
    return [*ops[:i], *moving, *ops[i:]]


@dataclass(slots=True)
class ForwardState:
    """Scratch record of one (half-)batch flowing through a layer op list. Owned by the executor running it;
    every op reads and writes only these declared fields (tensor shapes per op in the layers' docstrings).

    Attributes:
        hidden_states: [T, H] activations between ops. forward_batch: the (child) ``ForwardBatch``.
        residual: [T, H] residual stream (None before the first layer).
        q, k, v: attention scratch (layouts set by the attention module; ``v`` may be MLA's ``expand_kv``).
        attn_gate: [T, Hq * D] the output gate of gated attention (Qwen3.5-MoE), between its prepare and core.
        router_logits, topk_weights, topk_ids: MoE routing ([T, E], [T, k], [T, k]).
        dispatch_handle: the all-to-all handle between dispatch and combine.
        expert_input: the dispatch's answer (``raymoe.comm.expert_input``: pair rows [R, H] with local expert
            ids, or the low-latency [E_local, C, H] layout); expert_output: the experts' answer in the same layout.
        combined: [T, H] top-k weighted expert outputs back in token order.
        shared_output: [T, H] shared experts' output.
        moe_output: [T, H] the MLP's result, added to the residual by the layer.
    """

    hidden_states: torch.Tensor | None = None
    forward_batch: Any = None
    residual: torch.Tensor | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: Any = None
    attn_gate: torch.Tensor | None = None
    router_logits: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    dispatch_handle: Any = None
    expert_input: Any = None
    expert_output: torch.Tensor | None = None
    combined: torch.Tensor | None = None
    shared_output: torch.Tensor | None = None
    moe_output: torch.Tensor | None = None


def execute_operations(state: Any, operations: Sequence[Operation]) -> ForwardState:
    """Run ``operations`` on ``state`` in order, skipping yields; returns ``state``. A collective recording
    (``raymoe.comm.trace``) is told which op runs."""
    recorder = active_recorder()
    for op in operations:
        if not isinstance(op, YieldOperation):
            if recorder is not None:
                recorder.where = op
            op(state)
    if recorder is not None:
        recorder.where = None
    return state


def split_into_stages(operations: Sequence[Operation]) -> list[list[Callable[[Any], None]]]:
    """Cut ``operations`` at every :class:`YieldOperation`; empty stages are dropped."""
    stages: list[list[Callable[[Any], None]]] = []
    current: list[Callable[[Any], None]] = []
    for op in operations:
        if isinstance(op, YieldOperation):
            if current:
                stages.append(current)
            current = []
        else:
            current.append(op)
    if current:
        stages.append(current)
    return stages


class StageExecutor:
    """Runs one state through a list of stages, one stage per :meth:`next` call.

    Args:
        stages: from :func:`split_into_stages`.
        state: the (half-)batch state the ops read and write.
        child: which two-batch-overlap child this is (0 = A, 1 = B), told to a collective recording
            (``raymoe.comm.trace``) with each op; None: not a TBO child.
    """

    def __init__(self, stages: list[list[Callable[[Any], None]]], state: ForwardState, child: int | None = None):
        self.stages = stages
        self.state = state
        self.index = 0
        self.child = child

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def done(self) -> bool:
        return self.index >= len(self.stages)

    def next(self) -> None:
        """Run the next stage.

        Raises:
            RuntimeError: every stage has already run.
        """
        if self.done:
            raise RuntimeError("StageExecutor.next() called after the last stage")
        recorder = active_recorder()
        for op in self.stages[self.index]:
            if recorder is not None:
                recorder.child, recorder.where = self.child, op
            op(self.state)
        self.index += 1


def execute_overlapped_operations(inputs_arr: Sequence[ForwardState], operations_arr: Sequence[Sequence[Operation]],
                                  delta_stages: Sequence[int], streams: TboStreams | None = None) -> list[ForwardState]:
    """Two-batch overlap: run two states through their op lists, interleaved stage by stage.

    Child A runs ``delta`` stages on its own, then A and B alternate (A's stage ``i + delta``, then B's stage ``i``),
    then B runs its last ``delta`` stages. Communication started at the end of a stage of one child is thus in
    flight while the other child computes its next stage. The order of stages, and so of collectives, depends
    only on the stage counts and ``delta`` — every rank of a step must pass lists with the same stage structure.

    Args:
        inputs_arr: ``[state_a, state_b]``.
        operations_arr: ``[ops_a, ops_b]``; both must split into the same number of stages.
        delta_stages: ``[0, delta]``: child B starts ``delta`` stages after child A (clamped to the stage count).
        streams: the platform's streams (``raymoe.overlap.streams``): child B's stages run on a second stream,
            forked from and joined back into the current one; None: both children on the current stream.
    Returns:
        ``[state_a, state_b]`` after every stage ran.
    Raises:
        ValueError: not two children, child A with a nonzero delta, a negative delta, or different stage counts.
    """
    if len(inputs_arr) != 2 or len(operations_arr) != 2 or len(delta_stages) != 2:
        raise ValueError("two-batch overlap takes exactly two states, two op lists and two deltas")
    if delta_stages[0] != 0 or delta_stages[1] < 0:
        raise ValueError(f"delta_stages must be [0, d >= 0], got {list(delta_stages)}")
    executor_a = StageExecutor(split_into_stages(operations_arr[0]), inputs_arr[0], child=0)
    executor_b = StageExecutor(split_into_stages(operations_arr[1]), inputs_arr[1], child=1)
    if executor_a.num_stages != executor_b.num_stages:
        raise ValueError(f"children have {executor_a.num_stages} and {executor_b.num_stages} stages")
    delta = min(delta_stages[1], executor_a.num_stages)
    order = [0] * delta + [0, 1] * (executor_a.num_stages - delta) + [1] * delta
    executors = (executor_a, executor_b)
    if streams is None:
        for child in order:
            executors[child].next()
    else:
        streams.fork()
        for child in order:
            with streams.child(child):
                executors[child].next()
        state_b = executor_b.state
        streams.join([t for t in (state_b.hidden_states, state_b.residual) if t is not None])
    assert executor_a.done and executor_b.done
    recorder = active_recorder()
    if recorder is not None:
        recorder.child = recorder.where = None
    return [executor_a.state, executor_b.state]
