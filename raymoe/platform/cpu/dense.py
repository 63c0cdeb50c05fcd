"""The CPU platform's dense operations: the fused float32 kernels (``raymoe.platform.cpu.kernels``) for norms, q/k norm
with rotary embedding and softmax top-k routing, and linear layers over weights packed once at load
(``kernels.packed_linear``). A call the kernels cannot take (another dtype, a shape they do not cover, the
library off) runs the reference operation.

At decode sizes a CPU rank's step is a few hundred small operators, and on the CI machine each torch call costs
about 3 us before it does any arithmetic: ``F.rms_norm`` of [16, 128] takes 32 us, q/k norm plus RoPE about 150 us
per layer; one kernel call each takes a few microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raymoe.platform.cpu.kernels import cpu_ops, packed_linear
from raymoe.platform.interface import BlockScales, Rotary, WeightKind
from raymoe.platform.reference.dense import DenseOps


class CpuDenseOps(DenseOps):
    """Dense operations of a CPU rank (module docstring)."""

    def prepare_weight(self, weight: torch.Tensor, kind: WeightKind, scales: BlockScales | None = None) -> Any:
        """A packed copy (``packed_linear.PackedWeight``: 16-column panels, float32) of a float32 CPU weight, None
        for any other. An LM head's rows are first stored column-major (the same [V_local, H] tensor over
        [H, V_local] storage): ``F.linear`` then hands MKL a non-transposed operand it streams row by row, and a
        decode step reads the head cold (every layer and the other processes run between two heads); cold, that
        took 0.42 against 0.56 ms at [16, 128] x [128, 4096] on one thread of the CI machine (0.03-0.06 ms slower
        warm). A float32 CPU rank so holds its linear and expert weights twice: the packed copy serves the
        one-threaded small-row GEMM, the ``[out, in]`` weight every other path. An FP8 weight is not packed (a
        float32 copy would undo what FP8 saves): it keeps its ``scales`` and the reference path's weight-only
        dequantization."""
        if scales is not None:
            return super().prepare_weight(weight, kind, scales)
        if kind is WeightKind.LM_HEAD and weight.device.type == "cpu" and weight.dtype == torch.float32:
            weight.data = weight.data.t().contiguous().t()
        return packed_linear.pack(weight)

    def prepare_weight_slots(self, weight: torch.Tensor, kind: WeightKind, prepared: Any, slots: Sequence[int],
                             scales: BlockScales | None = None) -> Any:
        """A packed stacked weight repacks only the changed slots, in place (a layer's whole repack cost a two-rank
        decode step about 8 ms at [9, 1024, 256] + [9, 256, 512] on the CI machine); otherwise the reference."""
        if scales is None and isinstance(prepared, packed_linear.PackedWeight) and weight.dim() == 3 \
                and prepared.groups == weight.shape[0]:
            packed_linear.repack_groups(prepared, weight, slots)
            return prepared
        return super().prepare_weight_slots(weight, kind, prepared, slots, scales)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """The packed GEMM where ``packed_linear.use_packed`` holds (rows x intra-op threads <= 128), else
        ``F.linear``; an FP8 weight through the reference path (block dequantization, then ``F.linear``)."""
        if isinstance(prepared, BlockScales):
            return super().linear(x, weight, prepared, bias)
        return packed_linear.matmul(x, weight, prepared, bias)

    def weight_values(self, weight: torch.Tensor, prepared: Any, dtype: torch.dtype) -> torch.Tensor:
        """An FP8 weight dequantized by one kernel call (``cpu_ops.fp8_dequant``: a 256-entry table instead of
        torch's element-by-element float8 conversion) where the kernels load; else the reference."""
        if (isinstance(prepared, BlockScales) and weight.is_cpu and weight.is_contiguous()
                and prepared.scale.is_contiguous() and cpu_ops.enabled_for(prepared.scale)):
            return cpu_ops.fp8_dequant(weight, prepared.scale, prepared.block).to(dtype)
        return super().weight_values(weight, prepared, dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and weight.dim() == 1 and cpu_ops.enabled_for(x, weight):
            return cpu_ops.add_rms_norm(x, None, weight, eps)[0]
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and residual.dim() == 2 and weight.dim() == 1 and cpu_ops.enabled_for(x, residual, weight):
            return cpu_ops.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def qk_norm_rope(self, qk: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, rotary: Rotary,
                     positions: torch.Tensor) -> torch.Tensor:
        """One kernel call, in place in ``qk`` (neox rotary only)."""
        if not rotary.interleaved and cpu_ops.enabled_for(qk, rotary.cos):
            return cpu_ops.qk_norm_rope_(qk, norm_weight, eps, rotary.cos, rotary.sin, positions)
        return super().qk_norm_rope(qk, norm_weight, eps, rotary, positions)

    def topk_softmax(self, logits: torch.Tensor, top_k: int, renormalize: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_ops.enabled_for(logits):
            return cpu_ops.topk_softmax(logits, top_k, renormalize, scale)
        return super().topk_softmax(logits, top_k, renormalize, scale)
