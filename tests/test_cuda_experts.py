"""The CUDA platform's expert operations (``raymoe.platform.cuda.experts``) on CPU, through a strict double of
``torch._grouped_mm``'s CUTLASS path (``tests/grouped_mm_double.py``): every layout gives the reference's rows,
multiplies only its routed rows (DeepSeek-V3 shapes at ep = 16, M = 64: within 1.25x of routed rows times one
expert's FLOPs, where the reference's masked GEMMs issue about 32x), reads nothing on the host, and falls back to
the reference where the grouped GEMM does not take the rows; the double refuses what the real op refuses."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).parent))

from cuda_stream_double import CudaStreamDouble  # noqa: E402
from grouped_mm_double import GroupedMmRefused, StrictGroupedMm  # noqa: E402

from raymoe.comm.expert_input import NO_EXPERT, ExpertRows, GroupedExpertRows, MaskedExpertRows  # noqa: E402
from raymoe.platform.cuda.platform import CudaPlatform  # noqa: E402
from raymoe.platform.reference.platform import TorchPlatform  # noqa: E402
from raymoe.platform.reference.sync_guard import HostSyncGuard  # noqa: E402

H, INTER, EL = 64, 32, 4
REF = TorchPlatform()


def _experts(h: int = H, inter: int = INTER, el: int = EL, dtype=torch.bfloat16, seed: int = 0,
             device: str = "cpu") -> SimpleNamespace:
    """Local experts as the expert operations read them (``ExpertWeights``), seeded."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(el, 2 * inter, h, generator=g) * 0.2).to(device=device, dtype=dtype)
    w2 = (torch.randn(el, h, inter, generator=g) * 0.2).to(device=device, dtype=dtype)
    return SimpleNamespace(w13=w13, w2=w2, prepared13=None, prepared2=None, num_local=el, expert_start=0)


def _oracle(x: torch.Tensor, ids: list[int], experts) -> torch.Tensor:
    """Expert ``ids[i]`` on ``x[i]`` in float64 (0 for ``NO_EXPERT``)."""
    w13, w2 = experts.w13.double(), experts.w2.double()
    out = torch.zeros(len(ids), x.shape[1], dtype=torch.float64)
    for i, e in enumerate(ids):
        if e != NO_EXPERT:
            xi = x[i].double()
            out[i] = w2[e] @ (F.silu(w13[e, :INTER] @ xi) * (w13[e, INTER:] @ xi))
    return out


def _assert_bf16_close(y: torch.Tensor, oracle: torch.Tensor, reference: torch.Tensor) -> None:
    """``y`` is at most twice as far from the float64 ``oracle`` as the reference platform's bfloat16 answer
    ``reference`` on the same rows (or two bfloat16 ulps of the largest entry, whichever is larger)."""
    ref_err = float((reference.double() - oracle).abs().max())
    bound = 2 * max(ref_err, 2 ** -7 * float(oracle.abs().max()))
    err = float((y.double() - oracle).abs().max())
    assert err <= bound, (err, bound)


def _cuda() -> tuple[CudaPlatform, StrictGroupedMm]:
    double = StrictGroupedMm()
    return CudaPlatform(grouped_gemm=double, cuda_api=CudaStreamDouble()), double


def test_cuda_expert_layouts_equal_the_oracle_over_routed_rows_only():
    """Pair rows (with NO_EXPERT pairs: zero rows), sorted segments and the masked layout (NaN in every slot past
    its count, as DeepEP leaves them) go through the grouped GEMM, two calls each, and give the oracle's rows."""
    cuda, double = _cuda()
    experts = _experts()
    g = torch.Generator().manual_seed(1)

    x = torch.randn(20, H, generator=g).bfloat16()
    ids = torch.randint(-1, EL, (20,), generator=g)
    ids[:2] = NO_EXPERT
    rows = ExpertRows(x, ids)
    y = rows.compute(cuda, experts)
    _assert_bf16_close(y, _oracle(x, ids.tolist(), experts), rows.compute(REF, experts))
    assert bool((y[ids < 0] == 0).all()) and double.calls == 2

    counts = [3, 0, 5, 2]
    seg = torch.randn(16, H, generator=g).bfloat16()
    seg[sum(counts):] = float("nan")
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = GroupedExpertRows(seg, ends, expert_capacity=8)
    y = rows.compute(cuda, experts)
    owners = [e for e, c in enumerate(counts) for _ in range(c)]
    _assert_bf16_close(y[:sum(counts)], _oracle(seg, owners, experts), rows.compute(REF, experts)[:sum(counts)])
    assert double.calls == 4

    counts = torch.tensor([2, 0, 6, 3], dtype=torch.int32)
    masked = torch.full((EL, 6, H), float("nan")).bfloat16()
    for e, c in enumerate(counts.tolist()):
        masked[e, :c] = torch.randn(c, H, generator=g).bfloat16()
    rows = MaskedExpertRows(masked, counts, max_rows=12)
    before = int(double.flops)
    y, ref = rows.compute(cuda, experts), rows.compute(REF, experts)
    assert y.shape == masked.shape and double.calls == 6
    valid = [(e, c) for e, c in enumerate(counts.tolist()) if c]
    _assert_bf16_close(torch.cat([y[e, :c] for e, c in valid]),
                       torch.cat([_oracle(masked[e, :c], [e] * c, experts) for e, c in valid]),
                       torch.cat([ref[e, :c] for e, c in valid]))
    assert int(double.flops) - before == 11 * (2 * H * 2 * INTER + 2 * INTER * H)  # the 11 routed rows only


def test_cuda_expert_path_reads_nothing_on_the_host():
    """The graph-captured layouts (segments, masked) and the pair rows run under the host-sync guard."""
    cuda, double = _cuda()
    experts = _experts()
    counts = torch.tensor([1, 4, 0, 2], dtype=torch.int32)
    with HostSyncGuard():
        MaskedExpertRows(torch.randn(EL, 5, H).bfloat16(), counts, max_rows=10).compute(cuda, experts)
        GroupedExpertRows(torch.randn(12, H).bfloat16(), counts.cumsum(0).to(torch.int32), 5).compute(cuda, experts)
        ExpertRows(torch.randn(6, H).bfloat16(), torch.tensor([0, 3, -1, 1, 1, 2])).compute(cuda, experts)
    assert double.calls == 6


def test_masked_counts_past_the_row_bound_stay_inside_the_packed_rows():
    """Counts that break the step's bound (ranks that disagreed on the capacity) must not make the kernel read past
    the packed rows (it does not check its offsets; the double asserts them): the rows within the bound are still
    the oracle's, in expert order."""
    cuda, double = _cuda()
    experts = _experts()
    counts = torch.tensor([3, 2, 4, 1], dtype=torch.int32)
    x = torch.randn(EL, 4, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = MaskedExpertRows(x, counts, max_rows=6).compute(cuda, experts)                  # 10 valid rows, bound 6
    ref = MaskedExpertRows(x, counts, max_rows=6).compute(REF, experts)
    _assert_bf16_close(torch.cat([y[0, :3], y[1, :2], y[2, :1]]),
                       _oracle(torch.cat([x[0, :3], x[1, :2], x[2, :1]]), [0, 0, 0, 1, 1, 2], experts),
                       torch.cat([ref[0, :3], ref[1, :2], ref[2, :1]]))
    assert int(double.flops) == 6 * (2 * H * 2 * INTER + 2 * INTER * H)


def test_cuda_experts_fall_back_where_the_grouped_gemm_does_not_take_the_rows():
    """float32 rows (the real op would sync on its offsets) and a hidden size off the 16-byte rule run the
    reference operations, and the double is never called."""
    cuda, double = _cuda()
    for experts, x in ((_experts(dtype=torch.float32), torch.randn(EL, 3, H)),
                       (_experts(h=60), torch.randn(EL, 3, 60).bfloat16())):
        rows = MaskedExpertRows(x, torch.tensor([3, 1, 0, 2], dtype=torch.int32), max_rows=12)
        torch.testing.assert_close(rows.compute(cuda, experts), rows.compute(REF, experts))
    assert double.calls == 0


def test_reference_pair_rows_skip_no_expert_pairs():
    """The reference's pair rows (grouped GEMM in float32, one GEMM pair per expert in float64) answer 0 for
    NO_EXPERT pairs and the oracle elsewhere."""
    ids = torch.tensor([2, -1, 0, 3, -1, 2, 1])
    for dtype in (torch.float32, torch.float64):
        experts = _experts(dtype=dtype)
        x = torch.randn(7, H, dtype=dtype)
        y = ExpertRows(x, ids).compute(REF, experts)
        torch.testing.assert_close(y.double(), _oracle(x, ids.tolist(), experts), rtol=1e-5, atol=1e-5)
        assert bool((y[ids < 0] == 0).all())
    assert float(ExpertRows(x, torch.full((7,), -1)).compute(REF, _experts(dtype=torch.float64)).abs().sum()) == 0


def _refusals() -> dict[str, tuple[type, str]]:
    double = StrictGroupedMm()
    a = torch.randn(10, 16).bfloat16()
    b = torch.randn(3, 16, 8).bfloat16()
    offs = torch.tensor([2, 5, 9], dtype=torch.int32)
    wide = torch.randn(10, 17).bfloat16()
    cases = {
        "float32 operands": lambda: double(a.float(), b.float(), offs),
        "int64 offsets": lambda: double(a, b, offs.long()),
        "offsets per group": lambda: double(a, b, offs[:2]),
        "2-D offsets": lambda: double(a, b, offs.view(3, 1)),
        "decreasing offsets": lambda: double(a, b, torch.tensor([5, 2, 9], dtype=torch.int32)),
        "offsets past the rows": lambda: double(a, b, torch.tensor([2, 5, 11], dtype=torch.int32)),
        "negative first offset": lambda: double(a, b, torch.tensor([-1, 5, 9], dtype=torch.int32)),
        "row stride off 16 bytes": lambda: double(wide[:, :16], b, offs),
        "pointer off 16 bytes": lambda: double(wide[:, 1:], b, offs),
        "contraction mismatch": lambda: double(a, b[:, :8], offs),
        "bias": lambda: double(a, b, offs, bias=torch.zeros(8).bfloat16()),
        "float32 output": lambda: double(a, b, offs, out_dtype=torch.float32),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "accepted"
        except (GroupedMmRefused, RuntimeError) as e:
            out[name] = type(e).__name__
    return out


def test_double_refuses_what_the_cutlass_path_refuses_and_computes_the_groups():
    refused = _refusals()
    assert all(v != "accepted" for v in refused.values()), refused
    assert refused["decreasing offsets"] == refused["offsets past the rows"] == "RuntimeError"  # on the device
    double = StrictGroupedMm()
    a, b = torch.randn(10, 16).bfloat16(), torch.randn(3, 16, 8).bfloat16()
    y = double(a, b, torch.tensor([2, 2, 7], dtype=torch.int32))                  # an empty group included
    ref = torch.cat([a[:2].double() @ b[0].double(), a[2:7].double() @ b[2].double()])
    torch.testing.assert_close(y[:7].double(), ref, rtol=2e-2, atol=2e-2)
    assert bool(y[7:].isnan().all()) and int(double.flops) == 2 * 7 * 16 * 8
    assert double.takes(torch.bfloat16, torch.device("cpu"), b)
    assert not double.takes(torch.float32, torch.device("cpu"), b.float())
    assert not double.takes(torch.bfloat16, torch.device("cpu"), torch.randn(3, 12, 8).bfloat16())
    with pytest.raises(NotImplementedError):
        double(a, b[0], torch.tensor([10], dtype=torch.int32))


# DeepSeek-V3: hidden 7168, moe_intermediate 2048, 256 routed experts, top-8; ep = 16 ranks of 16 experts each,
# M = 64 tokens per rank (the DeepEP buffer's M_max as well).
V3_H, V3_I, V3_E, V3_K, EP, M = 7168, 2048, 256, 8, 16, 64
V3_EL = V3_E // EP


def _v3_routing() -> torch.Tensor:
    """Rows per local expert of rank 0 [16] int32: top-8 of 256 for each of the ep * M tokens (seeded scores)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randn(EP * M, V3_E, generator=g).topk(V3_K, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=V3_E)[:V3_EL].to(torch.int32)


def _v3_experts(device: str) -> SimpleNamespace:
    """Rank 0's 16 experts at V3 shapes: one expert's bfloat16 weights (zeros: the FLOPs do not depend on them)
    repeated by stride 0 (the grouped GEMM's rules hold; 88 MB instead of 1.4 GB)."""
    w13 = torch.zeros(1, 2 * V3_I, V3_H, dtype=torch.bfloat16, device=device).expand(V3_EL, -1, -1)
    w2 = torch.zeros(1, V3_H, V3_I, dtype=torch.bfloat16, device=device).expand(V3_EL, -1, -1)
    return SimpleNamespace(w13=w13, w2=w2, prepared13=None, prepared2=None, num_local=V3_EL, expert_start=0)


def _v3_rows(layout: str, counts: torch.Tensor, device: str):
    if layout == "masked":  # DeepEP low_latency_dispatch: [E_local, M_max * ep, H] + counts
        x = torch.zeros(V3_EL, EP * M, V3_H, dtype=torch.bfloat16, device=device)
        return MaskedExpertRows(x, counts.to(device), max_rows=EP * M * min(V3_K, V3_EL))
    x = torch.zeros(EP * M * V3_K, V3_H, dtype=torch.bfloat16, device=device)  # the torch low-latency dispatch
    return GroupedExpertRows(x, counts.cumsum(0).to(device=device, dtype=torch.int32), expert_capacity=EP * M)


def _flops(ops, rows, experts, double: StrictGroupedMm | None = None) -> int:
    """FLOPs the expert operation issues: torch's counter (batched and plain GEMMs) plus the grouped GEMM double's
    count (torch's counter has no formula for ``_grouped_mm``)."""
    with FlopCounterMode(display=False) as counter:
        rows.compute(ops, experts)
    return counter.get_total_flops() + (int(double.flops) if double is not None else 0)


@pytest.mark.parametrize("layout", ["masked", "segments"])
def test_v3_expert_flops_follow_the_routed_rows(layout):
    """DeepSeek-V3 at ep = 16, M = 64: the CUDA path issues at most 1.25x the routed rows times one expert's
    FLOPs; the reference (what CUDA ranks ran before: batched GEMMs over every slot of the masked layout, the
    segments spread into it) issues about E / k = 32x, counted on the meta device."""
    counts = _v3_routing()
    one_expert = 2 * V3_H * 2 * V3_I + 2 * V3_I * V3_H           # FLOPs of one row through one expert
    routed = int(counts.sum())
    ideal = routed * one_expert
    cuda, double = _cuda()
    new = _flops(cuda, _v3_rows(layout, counts, "cpu"), _v3_experts("cpu"), double)
    before = _flops(TorchPlatform(), _v3_rows(layout, counts, "meta"), _v3_experts("meta"))
    assert double.calls == 2
    assert ideal <= new <= 1.25 * ideal, (new / ideal, routed)
    assert before > 1.25 * ideal and before / ideal > 25, before / ideal
