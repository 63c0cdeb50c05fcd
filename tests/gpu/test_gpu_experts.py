"""The CUDA platform's expert GEMMs on a real GPU (``pytest -m gpu tests/gpu``; skipped without CUDA): where
``torch._grouped_mm`` runs its CUTLASS kernel (bfloat16, compute capability 9.x/10.x) every layout gives the
reference's rows in bfloat16 rounding, the masked layout also from a CUDA graph replayed with other counts (the
counts are read on the device), and DeepEP's NaN in the slots past each count never reaches a valid row. On other
GPUs the platform keeps the reference operations and the same rows come out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, INTER, EL, C = 256, 128, 8, 64  # multiples of 8 (the kernel's 16-byte rule); C = ep * M_max of a small buffer


def _experts(dtype=torch.bfloat16) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EL, 2 * INTER, H, generator=g) * 0.05).to("cuda", dtype)
    w2 = (torch.randn(EL, H, INTER, generator=g) * 0.05).to("cuda", dtype)
    return SimpleNamespace(w13=w13, w2=w2, prepared13=None, prepared2=None, num_local=EL, expert_start=0)


def _masked(counts: list[int], seed: int):
    from raymoe.comm.expert_input import MaskedExpertRows

    g = torch.Generator().manual_seed(seed)
    x = torch.full((EL, C, H), float("nan"))
    for e, c in enumerate(counts):
        x[e, :c] = torch.randn(c, H, generator=g)
    return MaskedExpertRows(x.to("cuda", torch.bfloat16), torch.tensor(counts, dtype=torch.int32, device="cuda"),
                            max_rows=EL * C // 2)


def _valid(y: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([y[e, :c] for e, c in enumerate(counts)]).float()


def _reference(rows, experts) -> torch.Tensor:
    """The reference's rows in float32 (NaN slots zeroed first: the reference multiplies every slot)."""
    from raymoe.platform.reference.platform import TorchPlatform

    x = torch.nan_to_num(rows.x.float())
    w = SimpleNamespace(**{**vars(experts), "w13": experts.w13.float(), "w2": experts.w2.float()})
    return TorchPlatform().expert_masked(type(rows)(x, rows.counts, rows.max_rows), w)


def test_cuda_masked_experts_match_the_reference_also_from_a_graph():
    from raymoe.platform.cuda.platform import CudaPlatform

    cuda, experts = CudaPlatform(), _experts()
    takes = cuda.grouped_ok(torch.empty(EL * C, H, dtype=torch.bfloat16, device="cuda"), experts)
    assert takes == (torch.cuda.get_device_capability()[0] in (9, 10))
    first, second = [5, 0, 64, 3, 1, 0, 17, 9], [0, 0, 0, 40, 2, 60, 0, 7]  # sums 99 and 109 <= max_rows 256
    rows = _masked(first, 1)
    y = rows.compute(cuda, experts)
    torch.testing.assert_close(_valid(y, first), _valid(_reference(rows, experts), first), rtol=3e-2, atol=3e-2)

    static = _masked(first, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static.compute(cuda, experts)  # warm-up outside the capture (workspace, cached index tensors)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static.compute(cuda, experts)
    other = _masked(second, 2)
    static.x.copy_(other.x)
    static.counts.copy_(other.counts)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(_valid(out, second), _valid(_reference(other, experts), second), rtol=3e-2, atol=3e-2)


def test_cuda_pair_rows_and_segments_match_the_reference():
    from raymoe.comm.expert_input import NO_EXPERT, ExpertRows, GroupedExpertRows
    from raymoe.platform.cuda.platform import CudaPlatform
    from raymoe.platform.reference.platform import TorchPlatform

    cuda, ref, experts = CudaPlatform(), TorchPlatform(), _experts()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, H, generator=g).to("cuda", torch.bfloat16)
    ids = torch.randint(0, EL, (40,), generator=g).cuda()
    ids[::7] = NO_EXPERT
    y = ExpertRows(x, ids).compute(cuda, experts)
    torch.testing.assert_close(y.float(), ExpertRows(x, ids).compute(ref, experts).float(), rtol=3e-2, atol=3e-2)
    assert bool((y[ids == NO_EXPERT] == 0).all())
    ends = torch.tensor([3, 3, 10, 12, 20, 20, 25, 30], dtype=torch.int32, device="cuda")
    seg = GroupedExpertRows(x, ends, expert_capacity=C).compute(cuda, experts)[:30]
    torch.testing.assert_close(seg.float(), GroupedExpertRows(x, ends, C).compute(ref, experts)[:30].float(),
                               rtol=3e-2, atol=3e-2)
