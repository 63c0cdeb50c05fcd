"""Operations: a layer's forward written as data (SGLang's op lists with yield separators).

An operation is a callable ``op(state) -> None`` that reads and writes attributes of a per-batch state object.
A :class:`YieldOperation` marks a stage boundary: the plain executor ignores it; the overlapped executor
switches to the other half-batch there, so communication started before a yield runs while the other half
computes. The per-layer op list is the single source of truth for both executors.

Stages: an op list ``[o1, o2, Y, o3, Y, o4]`` has the stages ``[o1, o2]``, ``[o3]``, ``[o4]``; a leading, trailing
or doubled yield adds no empty stage. :class:`StageExecutor` runs one state through its stages one ``next()`` at a
time; :func:`execute_overlapped_operations` interleaves two executors (the two-batch overlap schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class YieldOperation:
    """Stage separator (no work)."""

    def __repr__(self) -> str:
        return "Yield"


Operation = Callable[[Any], None] | YieldOperation


class ForwardState:
    """Mutable scratch record of one (half-)batch flowing through the op list (attributes set by the ops)."""

    def __init__(self, **kwargs: Any):
        self.__dict__.update(kwargs)


def execute_operations(state: ForwardState, operations: Sequence[Operation]) -> ForwardState:
    """Run ``operations`` on ``state`` in order, skipping yields; returns ``state``."""
    for op in operations:
        if not isinstance(op, YieldOperation):
            op(state)
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
    """

    def __init__(self, stages: list[list[Callable[[Any], None]]], state: ForwardState):
        self.stages = stages
        self.state = state
        self.index = 0

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
        for op in self.stages[self.index]:
            op(self.state)
        self.index += 1


def execute_overlapped_operations(inputs_arr: Sequence[ForwardState], operations_arr: Sequence[Sequence[Operation]],
                                  delta_stages: Sequence[int]) -> list[ForwardState]:
    """Two-batch overlap: run two states through their op lists, interleaved stage by stage.

    Child A runs ``delta`` stages on its own, then A and B alternate (A's stage ``i + delta``, then B's stage ``i``),
    then B runs its last ``delta`` stages. Communication started at the end of a stage of one child is thus in
    flight while the other child computes its next stage. The order of stages, and so of collectives, depends
    only on the stage counts and ``delta`` — every rank of a step must pass lists with the same stage structure.

    Args:
        inputs_arr: ``[state_a, state_b]``.
        operations_arr: ``[ops_a, ops_b]``; both must split into the same number of stages.
        delta_stages: ``[0, delta]``: child B starts ``delta`` stages after child A (clamped to the stage count).
    Returns:
        ``[state_a, state_b]`` after every stage ran.
    Raises:
        ValueError: not two children, child A with a nonzero delta, a negative delta, or different stage counts.
    """
    if len(inputs_arr) != 2 or len(operations_arr) != 2 or len(delta_stages) != 2:
        raise ValueError("two-batch overlap takes exactly two states, two op lists and two deltas")
    if delta_stages[0] != 0 or delta_stages[1] < 0:
        raise ValueError(f"delta_stages must be [0, d >= 0], got {list(delta_stages)}")
    executor_a = StageExecutor(split_into_stages(operations_arr[0]), inputs_arr[0])
    executor_b = StageExecutor(split_into_stages(operations_arr[1]), inputs_arr[1])
    if executor_a.num_stages != executor_b.num_stages:
        raise ValueError(f"children have {executor_a.num_stages} and {executor_b.num_stages} stages")
    delta = min(delta_stages[1], executor_a.num_stages)
    for _ in range(delta):
        executor_a.next()
    for _ in range(executor_a.num_stages - delta):
        executor_a.next()
        executor_b.next()
    for _ in range(delta):
        executor_b.next()
    assert executor_a.done and executor_b.done
    return [executor_a.state, executor_b.state]
