"""FP8 experts through the real DeepGEMM on a GPU (``pytest -m gpu tests/gpu``; skipped without CUDA or
``deep_gemm``): the masked and contiguous grouped FP8 GEMMs of ``raymoe.platform.cuda.deepgemm_experts`` give the
rows of the CPU double (``tests/deep_gemm_double.py``, which the CPU tests prove the platform against) within
bfloat16 rounding, and the masked path replays from a CUDA graph with other counts."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, INTER, EL, C = 512, 256, 8, 64


def _deep_gemm():
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - no wheel or no toolkit: skip
        pytest.skip(f"needs deep_gemm ({type(e).__name__})")
    return deep_gemm


def _experts(device: str) -> SimpleNamespace:
    from raymoe.models.fp8_checkpoint import quantize_weight
    from raymoe.platform.interface import BlockScales

    g = torch.Generator().manual_seed(0)

    def quant(n, k):
        qs, ss = zip(*(quantize_weight(torch.randn(n, k, generator=g) / k ** 0.5, "block", (128, 128))
                       for _ in range(EL)), strict=True)
        return torch.stack(qs).to(device), BlockScales(torch.stack(ss).to(device), (128, 128))

    w13, s13 = quant(2 * INTER, H)
    w2, s2 = quant(H, INTER)
    return SimpleNamespace(w13=w13, w2=w2, prepared13=s13, prepared2=s2, num_local=EL, expert_start=0)


def _ops(module):
    from raymoe.platform.cuda.deepgemm_experts import DeepGemmExperts
    from raymoe.platform.reference.platform import TorchPlatform

    return DeepGemmExperts(module), TorchPlatform().silu_and_mul


def test_deep_gemm_masked_and_contiguous_match_the_double():
    import deep_gemm_double

    real, silu = _ops(_deep_gemm())
    double, _ = _ops(deep_gemm_double)
    gpu, cpu = _experts("cuda"), _experts("cpu")
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 64, 17, 1, 33, 2, 9]
    x = torch.randn(EL, C, H, generator=g).bfloat16()
    cnt = torch.tensor(counts, dtype=torch.int32)
    assert real.fits(torch.bfloat16, gpu)
    y = real.masked_mlp(x.cuda(), cnt.cuda(), 16, gpu, silu).cpu()
    want = double.masked_mlp(x, cnt, 16, cpu, silu)
    for e, n in enumerate(counts):
        torch.testing.assert_close(y[e, :n].float(), want[e, :n].float(), rtol=2e-2, atol=2e-2)
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = torch.randn(int(ends[-1]) + 7, H, generator=g).bfloat16()
    y = real.contiguous_mlp(rows.cuda(), ends.cuda(), gpu, silu).cpu()
    want = double.contiguous_mlp(rows, ends, cpu, silu)
    n = int(ends[-1])
    torch.testing.assert_close(y[:n].float(), want[:n].float(), rtol=2e-2, atol=2e-2)


def test_deep_gemm_masked_replays_from_a_cuda_graph_with_other_counts():
    real, silu = _ops(_deep_gemm())
    gpu = _experts("cuda")
    x = torch.randn(EL, C, H, device="cuda").bfloat16()
    counts = torch.full((EL,), 8, dtype=torch.int32, device="cuda")
    real.masked_mlp(x, counts, 8, gpu, silu)  # warm-up (JIT compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = real.masked_mlp(x, counts, 8, gpu, silu)
    counts.copy_(torch.tensor([3, 0, 64, 1, 8, 8, 2, 40], dtype=torch.int32))
    graph.replay()
    eager = real.masked_mlp(x, counts, 8, gpu, silu)
    for e, n in enumerate(counts.tolist()):
        torch.testing.assert_close(out[e, :n], eager[e, :n])
