"""Reference dense operations in torch operators (any device, any dtype): linear, RMSNorm, q/k norm with rotary
embedding, softmax top-k routing. The methods of :class:`DenseOps` implement the dense part of
:class:`~raymoe.platform.interface.Platform`; other platforms override them and call back here for tensors their
kernels do not take."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from raymoe.platform.interface import BlockScales, WeightKind
from raymoe.platform.reference.fp8 import check_scales, dequantize


class DenseOps:
    """Torch implementations of the platform's dense operations (shapes in ``Platform``'s docstrings)."""

    def prepare_weight(self, weight: torch.Tensor, kind: WeightKind, scales: BlockScales | None = None) -> Any:
        """Nothing for a plain weight; an FP8 weight's ``scales`` (checked)."""
        if scales is None:
            return None
        check_scales(weight, scales)
        return scales

    def linear(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``; an FP8 weight is block-dequantized to ``x``'s dtype first (weight-only)."""
        if isinstance(prepared, BlockScales):
            weight = self.weight_values(weight, prepared, x.dtype)
        return F.linear(x, weight, bias)

    def weight_values(self, weight: torch.Tensor, prepared: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(prepared, BlockScales):
            return dequantize(weight, prepared, dtype)
        return weight.to(dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """One ``F.rms_norm`` call for float32 with a [D] weight (the same float32 operations as the written-out
        formula, bitwise, in about half the operator dispatches); other dtypes normalize in float32, cast back, then
        multiply by the weight (Hugging Face's order)."""
        if x.dtype == torch.float32 and weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = residual + x
        return self.rms_norm(h, weight, eps), h

    def qk_norm_rope(self, qk: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, rotary,
                     positions: torch.Tensor) -> torch.Tensor:
        if norm_weight is not None:
            qk = self.rms_norm(qk, norm_weight, eps)
        return rotary.rotate(positions, qk)

    def topk_softmax(self, logits: torch.Tensor, top_k: int, renormalize: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(scores, k=top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if scale != 1.0:
            weights = weights * scale
        return weights, ids
