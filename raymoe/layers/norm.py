"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as Hugging Face Qwen/Llama do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raymoe.platform.cpu.kernels import cpu_ops


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    Args:
        hidden_size: size of the normalized (last) dim.
        eps: added to the mean square.
        dtype: dtype of the weight (the model's dtype).
    Shapes: ``x`` [..., hidden_size] in any float dtype; output has ``x``'s dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))``, the normalization in float32, cast back to ``x``'s dtype before
    the weight multiplies it (Hugging Face's order).

    Shapes: ``x`` [..., D]; ``weight`` broadcastable to ``x`` ([D], or [heads, D] for per-head weights of a
    [T, heads, D] input). One ``torch.nn.functional.rms_norm`` call: the same float32 operations as the
    written-out formula (bitwise equal results), about half the operator dispatches on CPU.
    """
    if x.dtype == torch.float32 and weight.dim() == 1:
        if x.dim() == 2 and cpu_ops.enabled_for(x, weight):
            return cpu_ops.add_rms_norm(x, None, weight, eps)[0]
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the pre-norm residual step of a decoder layer.

    Shapes: ``x``, ``residual`` [T, D]; ``weight`` [D]. Float32 CPU tensors take one fused kernel call
    (``raymoe.platform.cpu.kernels.cpu_ops.add_rms_norm``), anything else the torch operators.
    """
    if x.dim() == 2 and residual.dim() == 2 and weight.dim() == 1 and cpu_ops.enabled_for(x, residual, weight):
        return cpu_ops.add_rms_norm(x, residual, weight, eps)
    h = residual + x
    return rms_norm(h, weight, eps), h
