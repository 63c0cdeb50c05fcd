"""Block dequantization of FP8 weights (``raymoe.platform.interface.BlockScales``), in torch operators on any device:
the reference every platform's FP8 arithmetic is compared with, and the weight-only path of CPU ranks (the FP8 weight
stays resident; each GEMM dequantizes it to the activations' dtype first, as DeepSeek's ``weight_dequant`` and
vLLM/SGLang's block-FP8 fallback do)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raymoe.comm.expert_input import ExpertWeights
from raymoe.platform.interface import BlockScales

FP8_DTYPE = torch.float8_e4m3fn


def check_scales(weight: torch.Tensor, scales: BlockScales) -> None:
    """Raises ValueError: ``weight`` is not ``float8_e4m3fn`` or ``scales`` does not cover it exactly."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"block scales go with a float8_e4m3fn weight, got {weight.dtype}")
    if not scales.fits(weight):
        raise ValueError(f"scale grid {tuple(scales.scale.shape)} with block {scales.block} does not cover weight "
                         f"{tuple(weight.shape)}")


def dequantize(weight: torch.Tensor, scales: BlockScales, dtype: torch.dtype) -> torch.Tensor:
    """``fp8[..., i, j] * scale[..., i // bn, j // bk]`` in float32, cast to ``dtype``: ``weight``
    ``float8_e4m3fn`` [..., N, K] -> [..., N, K] ``dtype`` (partial edge blocks take their block's scale). One
    broadcast multiply over the ``[gn, bn, gk, bk]`` block view (the weight zero-padded to whole blocks first where
    the edges are partial)."""
    n, k = weight.shape[-2:]
    bn, bk = scales.block
    lead = tuple(weight.shape[:-2])
    gn, gk = scales.scale.shape[-2:]
    w = weight.to(torch.float32)
    if (gn * bn, gk * bk) != (n, k):
        w = F.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    out = w.view(*lead, gn, bn, gk, bk) * scales.scale.view(*lead, gn, 1, gk, 1)
    out = out.view(*lead, gn * bn, gk * bk)
    if (gn * bn, gk * bk) != (n, k):
        out = out[..., :n, :k].contiguous()
    return out.to(dtype)


@dataclass(frozen=True)
class DequantizedExperts:
    """A rank's FP8 experts dequantized for one call (:class:`~raymoe.comm.expert_input.ExpertWeights`, nothing
    prepared): ``w13`` [E_local, 2 I, H], ``w2`` [E_local, H, I] in the activations' dtype."""

    w13: torch.Tensor
    w2: torch.Tensor
    num_local: int
    expert_start: int
    prepared13: Any = None
    prepared2: Any = None


def dense_experts(experts: ExpertWeights, dtype: torch.dtype,
                  values: Callable[[torch.Tensor, Any, torch.dtype], torch.Tensor] | None = None) -> ExpertWeights:
    """``experts`` itself where its weights are not FP8, else :class:`DequantizedExperts` in ``dtype``, dequantized
    by ``values(weight, scales, dtype)`` (a platform's ``weight_values``; None: :func:`dequantize`)."""
    if not isinstance(experts.prepared13, BlockScales):
        return experts
    values = values or dequantize
    return DequantizedExperts(values(experts.w13, experts.prepared13, dtype),
                              values(experts.w2, experts.prepared2, dtype), experts.num_local,
                              experts.expert_start)
