"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as Hugging Face Qwen/Llama do."""

from __future__ import annotations

import torch
from torch import nn


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
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
