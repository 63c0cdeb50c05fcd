"""DeepEP's FP8 low-latency dispatch (``use_fp8=True``) feeding DeepGEMM's masked FP8 GEMM, on two gloo ranks through
the CPU doubles of both libraries (``deep_ep_double``, ``deep_gemm_double``).

Checked: the dispatcher of an FP8 checkpoint's MoE layer moves FP8 rows with per-token-group scales (in DeepEP's
column-major scale layout); the experts read them as they are (two masked FP8 GEMMs, no second quantization) and
the combined output equals that of the bfloat16 dispatch whose rows the experts quantize themselves (the same
quantization: to within bfloat16 rounding), and is within what FP8 activations cost of the weight-only reference;
the dispatcher is chosen FP8 only where DeepEP takes it (bfloat16, hidden a multiple of 512, a low-latency mode);
the double refuses FP8 where DeepEP does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from raymoe.config import ParallelConfig  # noqa: E402

E, K, H, INTER, NUM_MAX = 8, 2, 512, 128, 8


def _fp8_local_experts(groups):
    from raymoe.models.fp8_checkpoint import quantize_weight
    from raymoe.platform.interface import BlockScales

    g = torch.Generator().manual_seed(0)

    def quant(n, k):
        qs, ss = zip(*(quantize_weight(torch.randn(n, k, generator=g) / k ** 0.5, "block", (128, 128))
                       for _ in range(E)), strict=True)
        return torch.stack(qs), torch.stack(ss)

    w13, s13 = quant(2 * INTER, H)
    w2, s2 = quant(H, INTER)
    el = E // groups.ep_size
    lo = groups.ep_rank * el
    return SimpleNamespace(w13=w13[lo:lo + el].contiguous(), w2=w2[lo:lo + el].contiguous(),
                           prepared13=BlockScales(s13[lo:lo + el].contiguous(), (128, 128)),
                           prepared2=BlockScales(s2[lo:lo + el].contiguous(), (128, 128)), num_local=el,
                           expert_start=lo)


def _moe(groups, deep, ops, experts, x, ids, w):
    h = deep.dispatch_a(x, ids, w, NUM_MAX)
    rows = deep.dispatch_b(h)
    deep.combine_a(h, rows.compute(ops, experts))
    return rows, deep.combine_b(h)


def _fp8_vs_bf16(groups) -> dict:
    import deep_ep_double as dd
    import deep_gemm_double
    from cuda_stream_double import CudaStreamDouble
    from grouped_mm_double import StrictGroupedMm

    from raymoe.comm.dispatcher import A2ABackendSpec
    from raymoe.platform.cuda.deepep_buffer import _REGISTRY
    from raymoe.platform.cuda.deepgemm_experts import DeepGemmExperts
    from raymoe.platform.cuda.platform import CudaPlatform
    from raymoe.platform.reference.platform import TorchPlatform
    from raymoe.platform.selector import _deepep

    buf = dd.buffer_class(dd.BF16_ANY_H)  # DeepEP's rules, but hidden sizes outside its kernel list allowed
    experts = _fp8_local_experts(groups)
    ops = CudaPlatform(grouped_gemm=StrictGroupedMm(), cuda_api=CudaStreamDouble(),
                       fp8_experts=DeepGemmExperts(deep_gemm_double))
    g = torch.Generator().manual_seed(10 + groups.ep_rank)
    n = 5 + groups.ep_rank
    x = torch.randn(n, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.softmax(torch.randn(n, K, generator=g), dim=-1).bfloat16()
    spec = A2ABackendSpec("deepep", "low_latency", NUM_MAX)
    out: dict = {}
    fp8 = _deepep(groups, E, spec, H, torch.bfloat16, buffer_factory=buf, fp8_experts=True)
    rows, y8 = _moe(groups, fp8, ops, experts, x, ids, w)
    out["use_fp8"] = fp8.use_fp8
    out["rows"] = (rows.x.dtype, rows.x_scale.dtype, tuple(rows.x_scale.shape), rows.x_scale.stride(1))
    _REGISTRY.clear()
    plain = _deepep(groups, E, spec, H, torch.bfloat16, buffer_factory=buf, fp8_experts=False)
    rows16, y16 = _moe(groups, plain, ops, experts, x, ids, w)
    out["plain_rows"] = rows16.x.dtype, rows16.x_scale is None
    out["fp8_vs_bf16"] = float((y8.float() - y16.float()).abs().max() / y16.float().abs().max())
    ref = TorchPlatform()
    _REGISTRY.clear()
    ref_deep = _deepep(groups, E, spec, H, torch.bfloat16, buffer_factory=buf, fp8_experts=False)
    _, y_ref = _moe(groups, ref_deep, ref, experts, x, ids, w)  # weight-only dequantization, bf16 activations
    out["vs_weight_only"] = float((y8.float() - y_ref.float()).norm() / y_ref.float().norm())
    _REGISTRY.clear()
    out["normal_mode_not_fp8"] = not _deepep(groups, E, A2ABackendSpec("deepep", "normal", NUM_MAX), H,
                                             torch.bfloat16, buffer_factory=buf, fp8_experts=True).use_fp8
    _REGISTRY.clear()
    out["hidden_256_not_fp8"] = not _deepep(groups, E, spec, 256, torch.bfloat16, buffer_factory=buf,
                                            fp8_experts=True).use_fp8
    _REGISTRY.clear()
    return out


def test_fp8_dispatch_feeds_the_masked_fp8_gemm_and_equals_the_bf16_dispatch():
    from dist_harness import run_ranks

    for r in run_ranks(_fp8_vs_bf16, ParallelConfig(tp_size=1, dp_size=2, ep_size=2)):
        assert r["use_fp8"] and r["rows"] == (torch.float8_e4m3fn, torch.float32, (E // 2, 2 * NUM_MAX, H // 128), 1)
        assert r["plain_rows"] == (torch.bfloat16, True)
        assert r["fp8_vs_bf16"] < 2 ** -7, r  # the same quantization, once in DeepEP, once in the experts
        assert r["vs_weight_only"] < 0.06, r
        assert r["normal_mode_not_fp8"] and r["hidden_256_not_fp8"]


def test_fp8_dispatch_is_refused_where_deep_ep_refuses_it():
    from raymoe.platform.cuda.deepep import DeepEPDispatcher

    fake = SimpleNamespace(ep_size=2, ep_group=None)
    for dtype, hidden in ((torch.float32, 512), (torch.bfloat16, 384)):
        with pytest.raises(ValueError, match="FP8 dispatch takes bfloat16 rows with hidden % 512"):
            DeepEPDispatcher(fake, E, hidden_size=hidden, dtype=dtype, use_fp8=True, buffer_factory=object)
