"""Fusions: a platform's declared rewrite of a forward's op list, where a run of ops becomes one op.

The per-layer op list (``layer.operations()``) stays the one source of every forward (plain, single-batch and
two-batch overlap). A platform that can compute a run of consecutive ops in one call declares a :class:`Fusion`:
the roles of the ops it replaces (:class:`~raymoe.overlap.operations.OpRole`, in order) and a builder that gets the
matched ops and returns the fused op, or None where it does not apply (a layer whose weights or sizes it cannot
take). :func:`apply_fusions` rewrites a list; no yield ever lies inside a fused run, so stage boundaries (and the
order of collectives) are untouched. A fused op must compute what the ops it replaces compute, and may run those
ops itself for a step it does not take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raymoe.overlap.operations import Operation, OpRole, YieldOperation, op_role


@dataclass(frozen=True)
class Fusion:
    """One declared rewrite.

    Attributes:
        name: for logs and tests.
        pattern: the roles of the consecutive ops the fused op replaces, in order (at least two).
        build: ``matched ops -> fused op | None``; called once per match when the list is rewritten.
    Raises:
        ValueError: a pattern of fewer than two roles.
    """

    name: str
    pattern: tuple[OpRole, ...]
    build: Callable[[Sequence[Operation]], Operation | None]

    def __post_init__(self) -> None:
        if len(self.pattern) < 2:
            raise ValueError(f"fusion {self.name!r} must replace at least two ops, got {self.pattern}")


def apply_fusions(operations: Sequence[Operation], fusions: Sequence[Fusion]) -> list[Operation]:
    """Copy of ``operations`` with every run that matches a fusion's pattern replaced by the op its builder
    returns (fusions are tried in order at each position, so list the longer of two overlapping patterns first;
    a builder's None leaves the run as it was). Yields never match a role, so a fused run never crosses a stage
    boundary."""
    out: list[Operation] = []
    i, n = 0, len(operations)
    while i < n:
        for fusion in fusions:
            k = len(fusion.pattern)
            run = operations[i:i + k]
            if len(run) == k and all(not isinstance(op, YieldOperation) and op_role(op) == role
                                     for op, role in zip(run, fusion.pattern, strict=True)):
                fused = fusion.build(run)
                if fused is not None:
                    out.append(fused)
                    i += k
                    break
        else:
            out.append(operations[i])
            i += 1
    return out
