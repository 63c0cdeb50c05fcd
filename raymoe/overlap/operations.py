"""Operations: a layer's forward written as data (SGLang's op lists with yield separators).

An operation is a callable ``op(state) -> None`` that reads and writes attributes of a per-batch state object.
A :class:`YieldOperation` marks a stage boundary: the plain executor ignores it; the overlapped executor
switches to the other half-batch there, so communication started before a yield runs while the other half
computes. The per-layer op list is the single source of truth for both executors.
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
