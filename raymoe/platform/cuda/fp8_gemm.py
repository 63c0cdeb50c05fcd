"""Block-scaled FP8 GEMMs on CUDA: DeepSeek-V3's recipe (arXiv:2412.19437, Sec. 3.3) through torch's scaled matmul.

A linear layer over an FP8 weight ``W`` [N, K] with 128 x 128 block scales ``S_w`` [ceil(N / 128), ceil(K / 128)]
quantizes its activations per token and per group of 128 channels on the fly (``per_token_group_quant``:
``s_x = amax(|x_group|) / 448``, as DeepSeek's ``act_quant`` and SGLang's ``per_token_group_quant_fp8``) and calls
``torch.nn.functional.scaled_mm(x_fp8, W^T, s_x, BlockWise1x128, S_w, BlockWise128x128)``: cuBLAS's block-scaled
FP8 GEMM on Hopper, accumulating in float32 and writing the activations' dtype. The argument layouts are the ones
torch checks (``aten/src/ATen/native/cuda/ScaledBlas.cpp``, ``_scaled_block1x128_block128x128``): ``x_fp8``
row-major, ``W^T`` column-major (the row-major weight transposed), ``s_x`` [M, K / 128] outer-dim-major (strides
``(1, M)``), ``S_w`` as [round_up(K / 128, 4), N / 128] with strides ``(1, round_up(K / 128, 4))``; K and N multiples
of 16, no float32 output with a bias (the bias is added after).

Where a call falls outside what that kernel takes (another block size, ``K`` not a multiple of 512, ``N`` not of 16,
float32 activations, a torch without ``scaled_mm``), the caller runs the reference weight-only dequantization. Every
operation here is a device kernel (no host reads), so decode CUDA graphs capture it. Nothing imports torch's CUDA
pieces at module level; tests pass a conformance double of ``scaled_mm`` (``tests/scaled_mm_double.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from raymoe.platform.interface import BlockScales

GROUP = 128
"""Activation quantization group and the weight block size the kernel takes (DeepSeek-V3's 128 x 128)."""
_FP8_MAX = 448.0
_EPS = 1e-10


def per_token_group_quant(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group FP8 quantization: ``x`` [M, K] (K a multiple of ``group``) ->
    (``float8_e4m3fn`` [M, K], float32 scales [M, K / group]) with ``x ~= q * scale`` per group;
    ``scale = max(amax, 1e-10) / 448``."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    scale = g.abs().amax(dim=-1).clamp_(min=_EPS) / _FP8_MAX                     # [M, K / group]
    q = (g / scale.unsqueeze(-1)).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scale


@dataclass(frozen=True)
class CudaBlockScales(BlockScales):
    """:class:`BlockScales` plus the weight scales in the layout the scaled matmul reads (``mm_scale``, None where
    the weight does not fit the kernel)."""

    mm_scale: torch.Tensor | None = None


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


class BlockFp8Gemm:
    """The block-scaled FP8 linear of a CUDA rank (module docstring).

    Args:
        scaled_mm: ``torch.nn.functional.scaled_mm`` or a conformance double (None: torch's, looked up on first
            use; where this torch has none, :meth:`fits` is False and callers take the reference path).
        scaling_type: the enum ``scaled_mm`` takes (None: ``torch.nn.functional.ScalingType``).
    """

    def __init__(self, scaled_mm: Callable | None = None, scaling_type=None):
        self._mm = scaled_mm
        self._types = scaling_type

    def _lookup(self) -> bool:
        if self._mm is None:
            import torch.nn.functional as F

            self._mm = getattr(F, "scaled_mm", None)
            self._types = getattr(F, "ScalingType", None)
        elif self._types is None:
            from torch.nn.functional import ScalingType

            self._types = ScalingType
        return self._mm is not None and self._types is not None

    @staticmethod
    def weight_fits(weight: torch.Tensor, scales: BlockScales) -> bool:
        """Whether a 2-D FP8 weight [N, K] takes the kernel: 128 x 128 blocks, ``K`` a multiple of 512 (whole
        activation groups, and a scale grid the kernel reads without padding rows), ``N`` a multiple of 16."""
        if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or tuple(scales.block) != (GROUP, GROUP):
            return False
        n, k = weight.shape
        return k % (4 * GROUP) == 0 and n % 16 == 0

    def prepare(self, weight: torch.Tensor, scales: BlockScales) -> CudaBlockScales:
        """``scales`` with the kernel's weight-scale layout where the weight fits it (:meth:`weight_fits`)."""
        mm_scale = None
        if self.weight_fits(weight, scales):
            kb = weight.shape[1] // GROUP
            padded = scales.scale.new_zeros(scales.scale.shape[0], _round_up(kb, 4))
            padded[:, :kb] = scales.scale
            mm_scale = padded.t()                          # [round_up(kb, 4), N / 128], strides (1, round_up(kb, 4))
        return CudaBlockScales(scales.scale, scales.block, mm_scale)

    def fits(self, x: torch.Tensor, prepared: BlockScales) -> bool:
        """Whether ``x`` [..., K] over a prepared weight takes the kernel: bfloat16 or float16 activations and a
        weight with ``mm_scale``, and this torch has ``scaled_mm``."""
        return (isinstance(prepared, CudaBlockScales) and prepared.mm_scale is not None
                and x.dtype in (torch.bfloat16, torch.float16) and self._lookup())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, prepared: CudaBlockScales,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ dequant(weight)^T (+ bias)`` with FP8 activations: ``x`` [..., K] bfloat16/float16 -> [..., N] in
        ``x``'s dtype (callers check :meth:`fits`)."""
        k = x.shape[-1]
        n = weight.shape[0]
        x2 = x.reshape(-1, k)
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], n)
        xq, sx = per_token_group_quant(x2)
        m = x2.shape[0]
        sx = torch.empty_strided(sx.shape, (1, m), dtype=sx.dtype, device=sx.device).copy_(sx)  # strides (1, M)
        t = self._types
        out = self._mm(xq, weight.t(), sx, t.BlockWise1x128, prepared.mm_scale, t.BlockWise128x128,
                       output_dtype=x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], n)
