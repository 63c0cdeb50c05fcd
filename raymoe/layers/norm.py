"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as Hugging Face Qwen/Llama do, through the rank's platform
(``Platform.rms_norm``: one fused kernel on a CPU rank)."""

from __future__ import annotations

import torch
from torch import nn

from raymoe.platform.interface import Platform


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    Args:
        hidden_size: size of the normalized (last) dim.
        eps: added to the mean square.
        dtype: dtype of the weight (the model's dtype).
        ops: the rank's platform.
    Shapes: ``x`` [..., hidden_size] in any float dtype; output has ``x``'s dtype.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: Platform):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + residual), x + residual)``: the pre-norm residual step; ``x``, ``residual`` [T, D]."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
