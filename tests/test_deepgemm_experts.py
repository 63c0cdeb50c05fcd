"""FP8 experts of the CUDA platform through DeepGEMM's grouped FP8 GEMMs (``raymoe.platform.cuda.deepgemm_experts``),
on CPU through the strict double of DeepGEMM's API (``tests/deep_gemm_double.py``).

Checked: the masked layout (DeepEP low-latency rows), expert pair rows (with NO_EXPERT rows) and sorted segments of
an FP8 checkpoint's experts go through two grouped FP8 GEMMs each, every call passing the library's checks, and
answer the FP8 product (activations quantized per token group of 128, weights per 128 x 128 block) within what
the activation quantization costs against the weight-only reference; rows the kernel leaves unwritten (NaN in the
double) never reach a valid row; calls that do not fit (widths not multiples of 128, other blocks, float32 rows,
DeepGEMM missing) keep the reference dequantization; the double refuses what the library refuses.
"""

from __future__ import annotations

from types import SimpleNamespace

import deep_gemm_double
import pytest
import torch
from cuda_stream_double import CudaStreamDouble
from grouped_mm_double import StrictGroupedMm

from raymoe.comm.expert_input import NO_EXPERT, ExpertRows, GroupedExpertRows, MaskedExpertRows
from raymoe.models.fp8_checkpoint import quantize_weight
from raymoe.platform.cuda.deepgemm_experts import DeepGemmExperts
from raymoe.platform.cuda.fp8_gemm import per_token_group_quant
from raymoe.platform.cuda.platform import CudaPlatform
from raymoe.platform.interface import BlockScales
from raymoe.platform.reference.fp8 import dequantize
from raymoe.platform.reference.platform import TorchPlatform

H, INTER, EL = 256, 128, 4


class CountingDeepGemm:
    """The double as a module, counting its calls."""

    def __init__(self):
        self.calls = {"contiguous": 0, "masked": 0}

    def m_grouped_fp8_gemm_nt_contiguous(self, *args, **kwargs):
        self.calls["contiguous"] += 1
        return deep_gemm_double.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)

    def m_grouped_fp8_gemm_nt_masked(self, *args, **kwargs):
        self.calls["masked"] += 1
        return deep_gemm_double.m_grouped_fp8_gemm_nt_masked(*args, **kwargs)

    get_mk_alignment_for_contiguous_layout = staticmethod(deep_gemm_double.get_mk_alignment_for_contiguous_layout)


def _fp8_experts(h: int = H, inter: int = INTER, el: int = EL, block=(128, 128), seed: int = 0) -> SimpleNamespace:
    """FP8 experts with block scales, as an FP8 checkpoint loads them."""
    g = torch.Generator().manual_seed(seed)

    def quant(n, k):
        qs, ss = zip(*(quantize_weight(torch.randn(n, k, generator=g) / k ** 0.5, "block", block)
                       for _ in range(el)), strict=True)
        return torch.stack(qs), BlockScales(torch.stack(ss), block)

    w13, s13 = quant(2 * inter, h)
    w2, s2 = quant(h, inter)
    return SimpleNamespace(w13=w13, w2=w2, prepared13=s13, prepared2=s2, num_local=el, expert_start=0)


def _cuda(module=None) -> tuple[CudaPlatform, CountingDeepGemm]:
    dg = module or CountingDeepGemm()
    return CudaPlatform(grouped_gemm=StrictGroupedMm(), cuda_api=CudaStreamDouble(),
                        fp8_experts=DeepGemmExperts(dg)), dg


def _q(x: torch.Tensor) -> torch.Tensor:
    """``x`` through per-token-group FP8 quantization, in float64."""
    q, s = per_token_group_quant(x.reshape(-1, x.shape[-1]))
    return (q.double().view(q.shape[0], -1, 128) * s.double()[..., None]).view(x.shape)


def _fp8_oracle(x: torch.Tensor, ids: list[int], experts) -> torch.Tensor:
    """The FP8 product of expert ``ids[i]`` on ``x[i]`` (activations quantized before each projection, the gate/up
    output rounded to bfloat16 as the kernel writes it), float64."""
    w13 = dequantize(experts.w13, experts.prepared13, torch.float64)
    w2 = dequantize(experts.w2, experts.prepared2, torch.float64)
    out = torch.zeros(len(ids), x.shape[1], dtype=torch.float64)
    for i, e in enumerate(ids):
        if e != NO_EXPERT:
            gu = (w13[e] @ _q(x[i:i + 1].float())[0]).to(torch.bfloat16).unsqueeze(0)
            act = TorchPlatform().silu_and_mul(gu)
            out[i] = w2[e] @ _q(act.float())[0]
    return out


def _close(y: torch.Tensor, want: torch.Tensor) -> None:
    assert not torch.isnan(y).any()
    err = float((y.double() - want).norm() / want.norm())
    assert err < 0.01, err


def test_the_masked_layout_runs_two_masked_fp8_gemms_over_the_valid_rows():
    cuda, dg = _cuda()
    experts = _fp8_experts()
    g = torch.Generator().manual_seed(1)
    c = 8
    x = torch.randn(EL, c, H, generator=g).bfloat16()
    counts = torch.tensor([3, 0, 8, 5], dtype=torch.int32)
    x[0, 3:] = float("nan")  # slots past the count hold anything (DeepEP leaves them)
    y = MaskedExpertRows(x, counts, max_rows=16).compute(cuda, experts)
    assert dg.calls == {"contiguous": 0, "masked": 2} and y.shape == (EL, c, H) and y.dtype == torch.bfloat16
    for e, n in enumerate(counts.tolist()):
        if n:
            _close(y[e, :n], _fp8_oracle(x[e, :n], [e] * n, experts))
    # FP8 activations cost a few percent against the weight-only reference
    ref = MaskedExpertRows(x[2:3].float(), counts[2:3], 8).compute(TorchPlatform(), SimpleNamespace(
        **{**vars(experts), "w13": experts.w13[2:3], "w2": experts.w2[2:3], "num_local": 1,
           "prepared13": BlockScales(experts.prepared13.scale[2:3], (128, 128)),
           "prepared2": BlockScales(experts.prepared2.scale[2:3], (128, 128))}))
    assert float((y[2].float() - ref[0]).norm() / ref[0].norm()) < 0.06


def test_pair_rows_and_segments_run_two_contiguous_fp8_gemms_with_aligned_segments():
    cuda, dg = _cuda()
    experts = _fp8_experts()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(150, H, generator=g).bfloat16()  # more rows than one 128-row block
    ids = torch.randint(0, EL, (150,), generator=g)
    ids[:5] = NO_EXPERT
    ids[5:140] = 1  # one expert's segment spans two aligned blocks
    y = ExpertRows(x, ids).compute(cuda, experts)
    assert dg.calls == {"contiguous": 2, "masked": 0}
    assert bool((y[:5] == 0).all())
    _close(y[5:], _fp8_oracle(x[5:], ids[5:].tolist(), experts))

    counts = torch.tensor([2, 0, 7, 1], dtype=torch.int32)
    ends = counts.cumsum(0, dtype=torch.int32)
    rows = torch.randn(16, H, generator=g).bfloat16()  # 10 segment rows + 6 rows past the last segment
    y = GroupedExpertRows(rows, ends, expert_capacity=8).compute(cuda, experts)
    owners = [e for e, n in enumerate(counts.tolist()) for _ in range(n)]
    _close(y[:10], _fp8_oracle(rows[:10], owners, experts))
    assert dg.calls == {"contiguous": 4, "masked": 0}


@pytest.mark.parametrize(("h", "inter", "block", "dtype"), [
    (192, 128, (128, 128), torch.bfloat16),   # H not a multiple of 128
    (256, 96, (128, 128), torch.bfloat16),    # expert width not a multiple of 128
    (256, 128, (64, 64), torch.bfloat16),     # another block size
    (256, 128, (128, 128), torch.float32),    # float32 rows
])
def test_calls_that_do_not_fit_keep_the_weight_only_reference(h, inter, block, dtype):
    cuda, dg = _cuda()
    experts = _fp8_experts(h, inter, block=block)
    x = torch.randn(6, h, generator=torch.Generator().manual_seed(3)).to(dtype)
    ids = torch.tensor([0, 1, 2, 3, 0, NO_EXPERT])
    y = ExpertRows(x, ids).compute(cuda, experts)
    assert dg.calls == {"contiguous": 0, "masked": 0}
    torch.testing.assert_close(y, ExpertRows(x, ids).compute(TorchPlatform(), experts))


def test_without_deep_gemm_the_reference_runs():
    ops = DeepGemmExperts(None)
    ops._module = None  # as after a failed import
    assert not ops.fits(torch.zeros(2, H, dtype=torch.bfloat16), _fp8_experts())


def test_the_double_refuses_what_deep_gemm_refuses():
    experts = _fp8_experts()
    w, s = experts.w13, experts.prepared13.scale
    xq, sx = per_token_group_quant(torch.randn(130, H).bfloat16())
    out = torch.empty(130, 2 * INTER, dtype=torch.bfloat16)
    ok = torch.zeros(130, dtype=torch.int32)
    deep_gemm_double.m_grouped_fp8_gemm_nt_contiguous((xq, sx), (w, s), out, ok)
    bad_layouts = [torch.cat([torch.zeros(100, dtype=torch.int32), torch.ones(30, dtype=torch.int32)]),  # 2 experts
                   torch.cat([torch.full((1,), -1, dtype=torch.int32), torch.zeros(129, dtype=torch.int32)])]
    for layout in bad_layouts:
        with pytest.raises(RuntimeError, match="128-row block|skipped whole"):
            deep_gemm_double.m_grouped_fp8_gemm_nt_contiguous((xq, sx), (w, s), out, layout)
    with pytest.raises(RuntimeError, match="kBFloat16"):
        deep_gemm_double.m_grouped_fp8_gemm_nt_contiguous((xq, sx), (w, s), out.float(), ok)
    with pytest.raises(RuntimeError, match="major_b"):
        deep_gemm_double.m_grouped_fp8_gemm_nt_contiguous((xq, sx), (w.transpose(1, 2).contiguous().transpose(1, 2),
                                                                     s), out, ok)
    with pytest.raises(RuntimeError, match="sfa"):
        deep_gemm_double.m_grouped_fp8_gemm_nt_contiguous((xq, sx[:, :1]), (w, s), out, ok)
    with pytest.raises(RuntimeError, match="int32"):
        deep_gemm_double.m_grouped_fp8_gemm_nt_contiguous((xq, sx), (w, s), out, ok.long())
    xm, sm = xq[:128].view(EL, 32, H), sx[:128].view(EL, 32, -1)
    out_m = torch.empty(EL, 32, 2 * INTER, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="expected_m > 0"):
        deep_gemm_double.m_grouped_fp8_gemm_nt_masked((xm, sm), (w, s), out_m, torch.zeros(EL, dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match="masked_m"):
        deep_gemm_double.m_grouped_fp8_gemm_nt_masked((xm, sm), (w, s), out_m, torch.zeros(EL), 4)
