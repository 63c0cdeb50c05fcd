"""A CPU conformance double of ``torch.nn.functional.scaled_mm`` for DeepSeek's block-scaled recipe
(``BlockWise1x128`` activations x ``BlockWise128x128`` weights), strict about what the CUDA implementation checks.

The checks follow torch's ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` (``_scaled_mm_cuda_v2_out`` and
``_scaled_block1x128_block128x128``): 2-D ``float8_e4m3fn`` operands, ``mat_a`` row-major and ``mat_b``
column-major (cuBLASLt's only FP8 layout), K and N multiples of 16, one float32 scale and one recipe per operand,
``scale_a`` [M, ceil(K / 128)] with strides ``(1, M)``, ``scale_b`` [round_up(ceil(K / 128), 4), ceil(N / 128)]
with strides ``(1, round_up(ceil(K / 128), 4))``, and a bias only in bfloat16/float16 with a non-float32 output.
Anything else raises ``ValueError`` as torch does. The product is computed in float64 block by block:
``out[m, n] = sum_kb (sum_{k in kb} a[m, k] b[k, n]) * scale_a[m, kb] * scale_b[kb, n // 128]``.
"""

from __future__ import annotations

from enum import Enum

import torch


class ScalingType(Enum):
    """The recipes this double knows (names as ``torch.nn.functional.ScalingType``)."""

    BlockWise1x128 = "1x128"
    BlockWise128x128 = "128x128"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


class ScaledMmDouble:
    """Callable like ``scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
    swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False)``; counts its
    calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                 swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(), use_fast_accum=False):
        _require(mat_a.dim() == 2 and mat_b.dim() == 2, "mat_a and mat_b must be matrices")
        _require(not contraction_dim, "contraction_dim is for packed fp4 only")
        m, k = mat_a.shape
        _require(mat_b.shape[0] == k, f"mat_a and mat_b shapes cannot be multiplied ({tuple(mat_a.shape)} and "
                 f"{tuple(mat_b.shape)})")
        n = mat_b.shape[1]
        _require(k % 16 == 0, "Expected trailing dimension of mat1 to be divisible by 16")
        _require(n % 16 == 0, "mat2 shape must be divisible by 16")
        _require(mat_a.dtype == torch.float8_e4m3fn and mat_b.dtype == torch.float8_e4m3fn,
                 f"deepseek recipe needs float8_e4m3fn operands, got {mat_a.dtype}, {mat_b.dtype}")
        _require(mat_a.stride(1) == 1 and mat_a.stride(0) >= k, "mat_a must be row-major")
        _require(mat_b.stride(0) == 1 and mat_b.stride(1) >= k, "mat_b must be column-major")
        _require(isinstance(scale_a, torch.Tensor) and isinstance(scale_b, torch.Tensor), "one scale per operand")
        _require(scale_recipe_a == ScalingType.BlockWise1x128 and scale_recipe_b == ScalingType.BlockWise128x128,
                 "Invalid scaling configuration (this double takes BlockWise1x128 x BlockWise128x128)")
        _require(swizzle_a is None and swizzle_b is None, "no swizzle for the deepseek recipe")
        kb, nb = _cdiv(k, 128), _cdiv(n, 128)
        _require(scale_a.dtype == torch.float32 and tuple(scale_a.shape) == (m, kb),
                 f"scale_a must have shape {m} x {kb} Float elements, got {tuple(scale_a.shape)}")
        _require(scale_a.stride(0) == 1 and (scale_a.stride(1) == m or (kb == 1 and scale_a.stride(1) == 1)),
                 f"scale_a must have strides (1, {m}); got {scale_a.stride()}")
        kb4 = _round_up(kb, 4)
        _require(scale_b.dtype == torch.float32 and tuple(scale_b.shape) == (kb4, nb),
                 f"scale_b must have shape {kb4} x {nb} Float elements, got {tuple(scale_b.shape)}")
        _require(scale_b.stride(0) == 1 and (scale_b.stride(1) == kb4 or (nb == 1 and scale_b.stride(1) == 1)),
                 f"scale_b must have strides (1, {kb4}); got {scale_b.stride()}")
        if bias is not None:
            _require(output_dtype != torch.float32, "Bias is not supported when out_dtype is set to Float32")
            _require(bias.dtype in (torch.bfloat16, torch.float16), "Bias must be BFloat16 or Half")
        self.calls += 1
        a, b = mat_a.double(), mat_b.double()
        out = torch.zeros(m, n, dtype=torch.float64)
        col_block = torch.arange(n) // 128
        for j in range(kb):
            part = a[:, j * 128:(j + 1) * 128] @ b[j * 128:(j + 1) * 128]
            out += part * scale_a[:, j:j + 1].double() * scale_b[j, col_block].double()[None, :]
        if bias is not None:
            out += bias.double()
        return out.to(output_dtype)
