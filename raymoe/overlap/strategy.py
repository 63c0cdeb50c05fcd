"""OperationsStrategy: where the stage boundaries of each layer go, per layer type and forward mode.

The per-layer op list (``layer.operations()``) stays the single source of truth; a strategy only inserts
:class:`YieldOperation` s before ops of given roles (:class:`~raymoe.overlap.operations.OpRole`, marked on the ops
themselves, never matched by name), may move the shared-experts op (it needs only the MoE input), and picks
``tbo_delta_stages`` (DESIGN section 4; stage boundaries follow SGLang's DeepSeek/Qwen3 schedules as described in
the TBO reference write-ups):

* DECODE, ``"fine"`` (``delta = 2``): ``[prepare_attn, attn.prepare] | [attn.core, prepare_mlp, gate, select] |
  [dispatch_a, shared experts] | [dispatch_b, experts, combine_a] | [combine_b] | [output, postprocess]``.
  The last stage merges with the next layer's first one. With child B two stages behind child A, A's dispatch
  is in flight during B's output + attention prepare (and A's shared experts), A's combine during B's attention
  core + gate, and symmetrically for B's transfers.
* DECODE, ``"coarse"``: the EXTEND schedule below. Each transfer is in flight during a whole attention or expert
  stage of the other child instead of a fraction of one, so on CPU, where a stage of a half-batch takes a few
  milliseconds, it hides about twice the latency (and switches children half as often); the two children also
  run the same layer's weights back to back, which leaves some of them in the last-level cache. Engine option
  ``OverlapConfig.tbo_decode_schedule`` (``auto``: coarse on CPU, fine on CUDA; :func:`resolve_decode_schedule`).
* EXTEND (``delta = 0``): ``[attention ... dispatch_a] | [dispatch_b, experts, combine_a] | [shared experts,
  combine_b, output, postprocess]`` (merging with the next layer's attention): the shared experts move after the
  combine start, so they compute while the other child's combine is in flight. A's dispatch is in flight during
  B's attention, B's dispatch during A's experts, A's combine during B's experts, B's combine during A's next
  attention (and shared experts).
* Dense layers (no MoE; e.g. DeepSeek's first layers) get no yields: each child runs the whole layer inside its
  current stage.

Every rank of a step must build the same stage structure (the stage order fixes the order of collectives), so
the schedule follows :func:`tbo_schedule_mode`, under which an IDLE rank uses the DECODE schedule; the driver's
decision (``raymoe.overlap.decision``) never runs an EXTEND TBO step next to IDLE or DECODE groups. A MoE layer
whose ops lack one of the roles a schedule needs is refused (:func:`check_roles`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.overlap.fusion import Fusion, apply_fusions
from raymoe.overlap.operations import Operation, OpRole, YieldOperation, move_before, op_role
from raymoe.step.forward_mode import ForwardMode

_DECODE_YIELD_BEFORE = frozenset({OpRole.ATTN_CORE, OpRole.DISPATCH_A, OpRole.DISPATCH_B, OpRole.COMBINE_B,
                                  OpRole.OUTPUT})
_EXTEND_YIELD_BEFORE = frozenset({OpRole.DISPATCH_B, OpRole.COMBINE_B})
_REQUIRED_ROLES = (OpRole.ATTN_CORE, OpRole.DISPATCH_A, OpRole.DISPATCH_B, OpRole.EXPERTS, OpRole.COMBINE_A,
                   OpRole.COMBINE_B, OpRole.OUTPUT)
DECODE_DELTA_STAGES = 2
EXTEND_DELTA_STAGES = 0
DECODE_SCHEDULES = ("fine", "coarse")


def resolve_decode_schedule(schedule: str, platform_default: str) -> str:
    """The DECODE TBO schedule (``"fine"`` or ``"coarse"``) of engine option ``schedule``: ``auto`` is the rank's
    platform's default (``Platform.default_tbo_decode_schedule``: coarse on CPU, where a half-batch stage takes
    milliseconds; fine, SGLang's schedule, on CUDA).

    Raises:
        ValueError: an unknown schedule name.
    """
    if schedule == "auto":
        schedule = platform_default
    if schedule not in DECODE_SCHEDULES:
        raise ValueError(f"unknown TBO decode schedule {schedule!r} (expected auto, fine or coarse)")
    return schedule


def check_roles(operations: Sequence[Operation], layer_id: object = "?") -> None:
    """Check that a MoE layer's ops carry each role a schedule needs exactly once (shared experts at most once).

    Raises:
        ValueError: a role is missing or repeated (names the layer and the role).
    """
    roles = [op_role(op) for op in operations]
    for role in _REQUIRED_ROLES:
        if roles.count(role) != 1:
            raise ValueError(f"layer {layer_id}: MoE op list has {roles.count(role)} ops marked {role.name}; "
                             "overlap schedules need exactly one")
    if roles.count(OpRole.SHARED_EXPERTS) > 1:
        raise ValueError(f"layer {layer_id}: more than one shared-experts op")


def tbo_schedule_mode(forward_mode: ForwardMode) -> ForwardMode:
    """The schedule a TBO step uses on a rank with ``forward_mode``: EXTEND for EXTEND, DECODE for DECODE,
    TARGET_VERIFY and IDLE (IDLE ranks must follow the schedule of the others, and TBO steps with IDLE groups are
    DECODE or verify steps; a verify step is a decode step with a few tokens per request).

    Raises:
        ValueError: MIXED (TBO never runs MIXED batches).
    """
    if forward_mode == ForwardMode.EXTEND:
        return ForwardMode.EXTEND
    if forward_mode in (ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY):
        return ForwardMode.DECODE
    raise ValueError(f"two-batch overlap does not support {forward_mode.name} batches")


def insert_yields(operations: Sequence[Operation], before: frozenset[OpRole]) -> list[Operation]:
    """Copy of ``operations`` with a yield before every op whose role is in ``before``."""
    out: list[Operation] = []
    for op in operations:
        if op_role(op) in before:
            out.append(YieldOperation())
        out.append(op)
    return out


def tbo_layer_operations(layer, mode: ForwardMode) -> list[Operation]:
    """One MoE layer's ops with the yields of ``mode``'s schedule (DECODE or EXTEND; see the module docstring).

    Raises:
        ValueError: the layer's ops lack a required role.
    """
    ops = layer.operations()
    check_roles(ops, getattr(layer, "layer_id", "?"))
    if mode == ForwardMode.DECODE:
        return insert_yields(ops, _DECODE_YIELD_BEFORE)
    ops = move_before(ops, OpRole.SHARED_EXPERTS, OpRole.COMBINE_B)
    has_shared = any(op_role(op) == OpRole.SHARED_EXPERTS for op in ops)
    before = {OpRole.DISPATCH_B, OpRole.SHARED_EXPERTS if has_shared else OpRole.COMBINE_B}
    return insert_yields(ops, frozenset(before))


class KVLayerMark:
    """The op ending decoder layer ``layer`` in every op list: tells the step's layer-by-layer KV writer
    (``forward_batch.kv_stream``, ``raymoe.kvcache.kv_stream``; prefill ranks of PD disaggregation) that this
    half of the step has stored the layer's KV. Costs one attribute read on every other step. Platform fusions
    never span layers, so the marks split no fused run."""

    __slots__ = ("layer",)

    def __init__(self, layer: int):
        self.layer = layer

    def __call__(self, state) -> None:
        stream = state.forward_batch.kv_stream
        if stream is not None:
            stream.layer_done(self.layer, state.forward_batch)

    def __repr__(self) -> str:
        return f"KVLayerMark({self.layer})"


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
    def plain(cls, layers: Sequence, fusions: Sequence[Fusion] = ()) -> OperationsStrategy:
        """Every layer's ops in order, no stage boundaries, with the platform's ``fusions`` applied
        (``raymoe.overlap.fusion``: runs of ops a kernel computes in one call)."""
        return cls([op for i, layer in enumerate(layers)
                    for op in (*apply_fusions(layer.operations(), fusions), KVLayerMark(i))])

    @classmethod
    def sbo(cls, layers: Sequence) -> OperationsStrategy:
        """Single-batch overlap: MoE layers' expert compute and combine interleaved (``raymoe.overlap.sbo``)."""
        from raymoe.overlap.sbo import sbo_operations

        return cls([op for i, layer in enumerate(layers) for op in (*sbo_operations(layer), KVLayerMark(i))])

    @classmethod
    def tbo(cls, layers: Sequence, forward_mode: ForwardMode, decode_schedule: str = "fine") -> OperationsStrategy:
        """Two-batch overlap schedule of ``layers`` for a rank whose batch has ``forward_mode``; DECODE (and IDLE)
        ranks use ``decode_schedule`` (``"fine"`` or ``"coarse"``, the same on every rank of the engine).

        Raises:
            ValueError: MIXED mode, or an unknown ``decode_schedule``.
        """
        if decode_schedule not in DECODE_SCHEDULES:
            raise ValueError(f"unknown TBO decode schedule {decode_schedule!r} (expected one of {DECODE_SCHEDULES})")
        mode = tbo_schedule_mode(forward_mode)
        if mode == ForwardMode.DECODE and decode_schedule == "coarse":
            mode = ForwardMode.EXTEND  # the prefill schedule's stages and delta
        ops: list[Operation] = []
        has_moe = False
        for i, layer in enumerate(layers):
            if getattr(layer, "is_moe", False):
                has_moe = True
                ops.extend(tbo_layer_operations(layer, mode))
            else:
                ops.extend(layer.operations())
            ops.append(KVLayerMark(i))
        delta = DECODE_DELTA_STAGES if mode == ForwardMode.DECODE else EXTEND_DELTA_STAGES
        return cls(ops, delta if has_moe else 0)
