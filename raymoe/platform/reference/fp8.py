"""Block dequantization of FP8 weights (``raymoe.platform.interface.BlockScales``), in torch operators on any device:
the reference every platform's FP8 arithmetic is compared with, and the weight-only path of CPU ranks (the FP8 weight
stays resident; each GEMM dequantizes it to the activations' dtype first, as DeepSeek's ``weight_dequant`` and
vLLM/SGLang's block-FP8 fallback do)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
    ``float8_e4m3fn`` [..., N, K] -> [..., N, K] ``dtype`` (partial edge blocks take their block's scale)."""
    n, k = weight.shape[-2:]
    bn, bk = scales.block
    s = scales.scale
    if bn > 1:
        s = s.repeat_interleave(bn, dim=-2)[..., :n, :]
    if bk > 1:
        s = s.repeat_interleave(bk, dim=-1)[..., :k]
    return (weight.to(torch.float32) * s).to(dtype)


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


def dense_experts(experts: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """``experts`` itself where its weights are not FP8, else :class:`DequantizedExperts` in ``dtype``."""
    if not isinstance(experts.prepared13, BlockScales):
        return experts
    return DequantizedExperts(dequantize(experts.w13, experts.prepared13, dtype),
                              dequantize(experts.w2, experts.prepared2, dtype), experts.num_local,
                              experts.expert_start)
