"""The CUDA platform's block-scaled FP8 linear on CPU, through the conformance double of torch's ``scaled_mm``
(``tests/scaled_mm_double.py``): the arguments it passes satisfy every layout check of torch's block-scaled path,
the result equals the FP8-quantized product computed here, and calls the kernel cannot take run the reference
dequantization."""

from __future__ import annotations

import pytest
import torch
from scaled_mm_double import ScaledMmDouble, ScalingType

from raymoe.models.fp8_checkpoint import quantize_weight
from raymoe.platform.cuda.fp8_gemm import BlockFp8Gemm, per_token_group_quant
from raymoe.platform.cuda.platform import CudaPlatform
from raymoe.platform.interface import BlockScales, WeightKind
from raymoe.platform.selector import reference_platform


def _case(n: int, k: int, m: int, block=(128, 128), seed=0):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight(torch.randn(n, k, generator=g) / k ** 0.5, "block", block)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return q, BlockScales(scale, block), x


def _expected(x, q, scales):
    """The FP8 product written out: activations quantized per token group, weights dequantized per block."""
    xq, sx = per_token_group_quant(x)
    xd = (xq.double().view(x.shape[0], -1, 128) * sx.double()[..., None]).view(x.shape)
    bn, bk = scales.block
    rows, cols = torch.arange(q.shape[0]) // bn, torch.arange(q.shape[1]) // bk
    w = q.double() * scales.scale.double()[rows[:, None], cols[None, :]]
    return xd @ w.T


@pytest.mark.parametrize(("n", "k", "m"), [(256, 512, 5), (176, 1024, 1), (128, 2048, 33)])
def test_fp8_linear_calls_the_block_scaled_kernel_with_its_layouts(n, k, m):
    double = ScaledMmDouble()
    ops = CudaPlatform(fp8_gemm=BlockFp8Gemm(double, ScalingType))
    q, scales, x = _case(n, k, m)
    prepared = ops.prepare_weight(q, WeightKind.LINEAR, scales)
    bias = torch.randn(n).to(torch.bfloat16)
    y = ops.linear(x, q, prepared, bias)
    assert double.calls == 1 and y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), _expected(x, q, scales) + bias.double(), rtol=2e-2, atol=2e-2)
    # against the weight-only reference: FP8 activations cost a few percent, no more
    ref = reference_platform().linear(x.float(), q, scales, bias.float())
    assert ((y.float() - ref).norm() / ref.norm()).item() < 0.06


def test_fp8_linear_keeps_leading_dims_and_empty_batches():
    double = ScaledMmDouble()
    ops = CudaPlatform(fp8_gemm=BlockFp8Gemm(double, ScalingType))
    q, scales, x = _case(128, 512, 6)
    prepared = ops.prepare_weight(q, WeightKind.LINEAR, scales)
    y = ops.linear(x.view(2, 3, 512), q, prepared)
    torch.testing.assert_close(y.view(6, 128), ops.linear(x, q, prepared))
    assert ops.linear(x[:0], q, prepared).shape == (0, 128)


@pytest.mark.parametrize(("n", "k", "block", "dtype"), [
    (128, 384, (128, 128), torch.bfloat16),     # K / 128 = 3: the kernel would need a padded scale grid
    (120, 512, (128, 128), torch.bfloat16),     # N not a multiple of 16
    (128, 512, (64, 64), torch.bfloat16),       # another block size
    (128, 512, (128, 128), torch.float32),      # float32 activations
])
def test_calls_the_kernel_cannot_take_run_the_reference(n, k, block, dtype):
    double = ScaledMmDouble()
    ops = CudaPlatform(fp8_gemm=BlockFp8Gemm(double, ScalingType))
    q, scales, x = _case(n, k, 4, block)
    prepared = ops.prepare_weight(q, WeightKind.LINEAR, scales)
    y = ops.linear(x.to(dtype), q, prepared)
    assert double.calls == 0
    torch.testing.assert_close(y, reference_platform().linear(x.to(dtype), q, scales))


def test_the_double_refuses_what_torch_refuses():
    """The double is strict: a row-major weight, row-major activation scales or an unpadded weight-scale grid are
    errors (so a wrong layout in the platform could not pass the tests above)."""
    double = ScaledMmDouble()
    q, scales, x = _case(128, 512, 4)
    xq, sx = per_token_group_quant(x)
    good_sx = sx.t().contiguous().t()
    good_sw = BlockFp8Gemm(double, ScalingType).prepare(q, scales).mm_scale
    args = (xq, q.t(), good_sx, ScalingType.BlockWise1x128, good_sw, ScalingType.BlockWise128x128)
    double(*args)
    with pytest.raises(ValueError, match="column-major"):
        double(xq, q.t().contiguous(), *args[2:])
    with pytest.raises(ValueError, match="strides"):
        double(xq, q.t(), sx.contiguous(), *args[3:])
    with pytest.raises(ValueError, match="scale_b must have"):
        double(*args[:4], scales.scale, ScalingType.BlockWise128x128)
    with pytest.raises(ValueError, match="Bias"):
        double(*args, bias=torch.zeros(128), output_dtype=torch.float32)
