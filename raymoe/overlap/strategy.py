"""OperationsStrategy: where the stage boundaries of each layer go, per layer type and forward mode.

The per-layer op list (``layer.operations()``) stays the single source of truth; a strategy only inserts
:class:`YieldOperation` s before named ops and picks ``tbo_delta_stages`` (DESIGN section 4; stage boundaries
follow SGLang's Qwen3-MoE schedules as described in the TBO reference write-ups):

* DECODE (``delta = 2``): ``[prepare_attn, attn.prepare] | [attn.core, prepare_mlp, gate, select] |
  [dispatch_a (+ shared experts)] | [dispatch_b, experts, combine_a] | [combine_b] | [output, postprocess]``.
  The last stage merges with the next layer's first one. With child B two stages behind child A, A's dispatch
  is in flight during B's output + attention prepare, A's combine during B's attention core + gate, and
  symmetrically for B's transfers.
* EXTEND (``delta = 0``): ``[attention ... dispatch_a] | [dispatch_b, experts, combine_a] | [combine_b, output,
  postprocess]`` (merging with the next layer's attention). A's dispatch is in flight during B's attention,
  B's dispatch during A's experts, A's combine during B's experts, B's combine during A's next attention.
* Dense layers (no MoE) get no yields: each child runs the whole layer inside its current stage.

Every rank of a step must build the same stage structure (the stage order fixes the order of collectives), so
the schedule follows :func:`tbo_schedule_mode`, under which an IDLE rank uses the DECODE schedule; the driver's
decision (``raymoe.overlap.decision``) never runs an EXTEND TBO step next to IDLE or DECODE groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.overlap.operations import Operation, YieldOperation
from raymoe.step.forward_mode import ForwardMode

# Yields go right before these ops (matched by the op's ``__name__``).
_DECODE_YIELD_BEFORE = frozenset({"op_core", "op_dispatch_a", "op_dispatch_b", "op_combine_b", "op_output"})
_EXTEND_YIELD_BEFORE = frozenset({"op_dispatch_b", "op_combine_b"})
DECODE_DELTA_STAGES = 2
EXTEND_DELTA_STAGES = 0


def op_name(op: Operation) -> str:
    """Name of an op (bound method or callable object) used to place stage boundaries."""
    return getattr(op, "__name__", type(op).__name__)


def tbo_schedule_mode(forward_mode: ForwardMode) -> ForwardMode:
    """The schedule a TBO step uses on a rank with ``forward_mode``: EXTEND for EXTEND, DECODE for DECODE and
    IDLE (IDLE ranks must follow the schedule of the others, and TBO steps with IDLE groups are DECODE steps).

    Raises:
        ValueError: MIXED (TBO never runs MIXED batches).
    """
    if forward_mode == ForwardMode.EXTEND:
        return ForwardMode.EXTEND
    if forward_mode in (ForwardMode.DECODE, ForwardMode.IDLE):
        return ForwardMode.DECODE
    raise ValueError(f"two-batch overlap does not support {forward_mode.name} batches")


def insert_yields(operations: Sequence[Operation], before: frozenset[str]) -> list[Operation]:
    """Copy of ``operations`` with a yield before every op whose name is in ``before``."""
    out: list[Operation] = []
    for op in operations:
        if op_name(op) in before:
            out.append(YieldOperation())
        out.append(op)
    return out


@dataclass(frozen=True)
class OperationsStrategy:
    """The op list of a whole forward (all layers concatenated) and child B's stage delay under TBO.

    Attributes:
        operations: ops and yields in execution order.
        tbo_delta_stages: stages child A runs before child B starts (0 for the plain and SBO paths).
    """

    operations: list[Operation]
    tbo_delta_stages: int = 0

    @classmethod
    def plain(cls, layers: Sequence) -> OperationsStrategy:
        """Every layer's ops in order, no stage boundaries."""
        return cls([op for layer in layers for op in layer.operations()])

    @classmethod
    def sbo(cls, layers: Sequence) -> OperationsStrategy:
        """Single-batch overlap: MoE layers' expert compute and combine interleaved (``raymoe.overlap.sbo``)."""
        from raymoe.overlap.sbo import sbo_operations

        return cls([op for layer in layers for op in sbo_operations(layer)])

    @classmethod
    def tbo(cls, layers: Sequence, forward_mode: ForwardMode) -> OperationsStrategy:
        """Two-batch overlap schedule of ``layers`` for a rank whose batch has ``forward_mode``.

        Raises:
            ValueError: MIXED mode.
        """
        mode = tbo_schedule_mode(forward_mode)
        before, delta = ((_DECODE_YIELD_BEFORE, DECODE_DELTA_STAGES) if mode == ForwardMode.DECODE
                         else (_EXTEND_YIELD_BEFORE, EXTEND_DELTA_STAGES))
        ops: list[Operation] = []
        has_moe = False
        for layer in layers:
            if getattr(layer, "is_moe", False):
                has_moe = True
                ops.extend(insert_yields(layer.operations(), before))
            else:
                ops.extend(layer.operations())
        return cls(ops, delta if has_moe else 0)
