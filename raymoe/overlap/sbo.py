"""Single-batch overlap (SBO): the MoE combine of one part of the expert rows runs while the next part computes.

SGLang's SBO overlaps the combine with the experts' down projection (and shared experts) on a second CUDA stream.
Qwen3-MoE has no shared experts, so on raymoe the block's received rows are processed in ``num_parts`` parts:
part ``p`` takes, of every peer's chunk of received rows, the slice ``[c * p // n, c * (p + 1) // n)``
(``raymoe.comm.all_to_all.part_row_index``); as soon as a part's expert outputs exist its combine transfer is
started (``combine_a(..., part=p, num_parts=n)``), then the next part computes while it is in flight.
``combine_b`` waits for all parts and reassembles them, so the result equals the plain path's (every expert
output row depends only on its own input row). A block with shared experts (DeepSeek) runs them right after the
last part's combine started and before ``op_combine_b`` waits, so they compute while that transfer is in flight
(SGLang's combine/shared-experts overlap).

Every rank must use the same setting (the number of combine collectives per layer changes); it is a per-engine
option (``OverlapConfig.enable_sbo``), mutually exclusive with two-batch overlap.
"""

from __future__ import annotations

from raymoe.comm.all_to_all import part_row_index
from raymoe.comm.expert_input import ExpertRows
from raymoe.overlap.operations import Operation, OpRole, move_before

DEFAULT_NUM_PARTS = 2


class SboExpertsCombine:
    """Op replacing a MoE block's ``op_experts`` + ``op_combine_a``: experts and combine start, part by part.

    Reads ``state.expert_input`` (pair rows [R, H] with local expert ids) and ``state.dispatch_handle``; leaves the
    combine in flight for the block's ``op_combine_b``. A low-latency dispatch (fixed layout) is combined in one
    part: its message has a fixed layout that parts cannot cut.

    Args:
        mlp: the ``SparseMoeBlock`` (uses its ``experts`` and ``a2a``).
        num_parts: row parts (>= 1).
    """

    __name__ = "op_experts_combine_sbo"

    def __init__(self, mlp, num_parts: int = DEFAULT_NUM_PARTS):
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        self.mlp = mlp
        self.num_parts = num_parts

    def __call__(self, state) -> None:
        rows, handle = state.expert_input, state.dispatch_handle
        if not isinstance(rows, ExpertRows):  # low-latency layout: one combine message, no parts
            self.mlp.a2a.combine_a(handle, self.mlp.experts.forward_input(rows))
            state.expert_input = state.expert_output = None
            return
        for part in range(self.num_parts):
            index = part_row_index(handle.recv_counts, part, self.num_parts, rows.x.device)
            out = self.mlp.experts(rows.x[index], rows.local_ids[index])
            self.mlp.a2a.combine_a(handle, out, part=part, num_parts=self.num_parts)
        state.expert_input = state.expert_output = None


def sbo_operations(layer, num_parts: int = DEFAULT_NUM_PARTS) -> list[Operation]:
    """``layer.operations()`` with its MoE block's ``op_experts, op_combine_a`` pair replaced by
    :class:`SboExpertsCombine` (and shared experts, if any, moved right before ``op_combine_b``); a layer without a
    MoE block is returned unchanged.

    Raises:
        ValueError: a MoE layer whose op list lacks ``op_experts`` directly followed by ``op_combine_a``.
    """
    ops = list(layer.operations())
    if not getattr(layer, "is_moe", False):
        return ops
    mlp = layer.mlp
    for i in range(len(ops) - 1):
        if ops[i] == mlp.op_experts and ops[i + 1] == mlp.op_combine_a:
            fused = [*ops[:i], SboExpertsCombine(mlp, num_parts), *ops[i + 2:]]
            return move_before(fused, OpRole.SHARED_EXPERTS, OpRole.COMBINE_B)
    raise ValueError(f"layer {getattr(layer, 'layer_id', '?')}: no op_experts -> op_combine_a pair to overlap")
