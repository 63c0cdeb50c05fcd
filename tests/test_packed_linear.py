"""The packed small-M GEMM (``csrc/gemm.c`` through ``raymoe.platform.cpu.kernels.packed_linear``) and the layers
that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raymoe.comm.groups import ParallelGroups
from raymoe.platform.cpu.kernels import build, packed_linear

pytestmark = pytest.mark.skipif(build.load() is None, reason="fused CPU kernels unavailable (no C compiler)")


@pytest.mark.parametrize("n,k", [(16, 8), (17, 33), (8192, 128), (5, 1), (40, 1024)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 64])
def test_linear_matches_torch(n, k, rows):
    """Every row-tile height (1-6 rows), output columns past the last whole panel, and strided rows."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, 2 * k, generator=g)[:, :k]  # row stride 2k: the kernel reads rows in place
    p = packed_linear.pack(w)
    assert p is not None and tuple(p.data.shape) == (1, -(-n // 16), k, 16)
    bias = torch.randn(n, generator=g)
    torch.testing.assert_close(packed_linear.linear(x, p), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed_linear.linear(x, p, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_linear_takes_leading_dims_and_column_major_weights():
    w = torch.randn(24, 10).t().contiguous().t()  # column-major [24, 10], as the CPU LM head stores it
    p = packed_linear.pack(w)
    x = torch.randn(2, 3, 10)
    y = packed_linear.linear(x, p)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="input features"):
        packed_linear.linear(torch.randn(3, 11), p)


def test_grouped_linear_matches_grouped_mm_and_zeroes_the_tail():
    """Empty groups, a group at the end, and padding rows past the last segment (zero, never garbage: a combine
    could weigh them by 0, and 0 x NaN is NaN)."""
    w = torch.randn(4, 24, 32)
    p = packed_linear.pack(w)
    x = torch.randn(12, 32)
    ends = torch.tensor([3, 3, 7, 9], dtype=torch.int32)
    y = packed_linear.grouped_linear(x, ends, p)
    ref = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
    torch.testing.assert_close(y[:9], ref[:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(y[9:], torch.zeros(3, 24))
    for bad in ([3, 2, 7, 9], [3, 3, 7, 13]):
        with pytest.raises(ValueError, match="non-decreasing"):
            packed_linear.grouped_linear(x, torch.tensor(bad, dtype=torch.int32), p)
    with pytest.raises(ValueError, match="int32"):
        packed_linear.grouped_linear(x, ends.long(), p)


def test_pack_declines_what_the_kernel_cannot_take():
    assert packed_linear.pack(torch.randn(4, 4, dtype=torch.bfloat16)) is None
    assert packed_linear.pack(torch.randn(4, 4, device="meta")) is None
    with pytest.raises(ValueError, match="N, K"):
        packed_linear.pack(torch.randn(4))
    build.reset(enabled=False)
    try:
        assert packed_linear.pack(torch.randn(4, 4)) is None
    finally:
        build.reset()
    with pytest.raises(ValueError, match="does not hold"):
        packed_linear.PackedWeight(torch.zeros(1, 2, 4, 16), out_features=40, in_features=4, groups=1)


def test_use_packed_bounds_rows_by_threads():
    """One thread: up to 128 rows; with MKL's threads available the bound shrinks (rows x threads <= 128)."""
    p = packed_linear.pack(torch.randn(16, 8))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert packed_linear.use_packed(p, torch.randn(128, 8))
        assert not packed_linear.use_packed(p, torch.randn(129, 8))
        assert not packed_linear.use_packed(None, torch.randn(4, 8))
        assert not packed_linear.use_packed(p, torch.randn(4, 8, dtype=torch.float64))
        torch.set_num_threads(2)
        assert packed_linear.use_packed(p, torch.randn(64, 8))
        assert not packed_linear.use_packed(p, torch.randn(65, 8))
    finally:
        torch.set_num_threads(threads)


def test_layers_are_prepared_at_load_by_their_platform():
    """A linear layer loaded on the CPU platform keeps a packed copy and computes F.linear's result through it; on
    the reference platform it keeps nothing; after a move to bfloat16 the packed copy is not taken (the input's
    dtype rules it out) and the result follows the moved weight."""
    from raymoe.layers.linear import ColumnParallelLinear
    from raymoe.platform.selector import reference_platform, select_platform

    class Reader:
        def __init__(self, t):
            self.t = t

        def shape(self, name):
            return tuple(self.t.shape)

        def get_slice(self, name, dim, start, end, dtype):
            return self.t.narrow(dim, start, end - start).to(dtype)

    w = torch.randn(40, 24)
    x = torch.randn(5, 24)
    layer = ColumnParallelLinear(24, [40], ParallelGroups.single(), torch.float32, select_platform("cpu"))
    assert layer.prepared is None
    layer.load(Reader(w), ["w"])
    assert isinstance(layer.prepared, packed_linear.PackedWeight)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    layer.to(torch.bfloat16)
    torch.testing.assert_close(layer(x.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    ref = ColumnParallelLinear(24, [40], ParallelGroups.single(), torch.float32, reference_platform())
    ref.load(Reader(w), ["w"])
    assert ref.prepared is None
    torch.testing.assert_close(ref(x), F.linear(x, w))


def test_experts_grouped_layout_through_packed_weights_equals_grouped_mm():
    """``LocalExperts`` on the CPU platform (stacks packed at load) gives the reference platform's
    ``torch._grouped_mm`` rows (sorted and segment forms)."""
    from raymoe.layers.moe import LocalExperts
    from raymoe.platform.cpu.kernels.packed_linear import pack
    from raymoe.platform.selector import reference_platform, select_platform

    ref, cpu = reference_platform(), select_platform("cpu")
    experts = LocalExperts(4, 32, 24, ParallelGroups.single(), torch.float32, cpu)
    g = torch.Generator().manual_seed(5)
    experts.w13.data.copy_(torch.randn(4, 48, 32, generator=g) / 6)
    experts.w2.data.copy_(torch.randn(4, 32, 24, generator=g) / 5)
    x = torch.randn(13, 32, generator=g)
    ids = torch.tensor([3, 0, 0, 2, 3, 3, 0, 2, 2, 0, 3, 3, 0])
    ends = torch.tensor([5, 5, 8, 13], dtype=torch.int32)
    want = ref.expert_rows(x, ids, experts), ref.expert_segments(x, ends, 5, experts)
    experts.prepared13, experts.prepared2 = pack(experts.w13), pack(experts.w2)
    got = cpu.expert_rows(x, ids, experts), cpu.expert_segments(x, ends, 5, experts)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_repack_groups_updates_only_the_rewritten_slots():
    """A rebalance rewrites slots of a stacked expert weight in place; repacking those slots alone gives what a
    whole repack gives, and the other slots' panels are not touched."""
    torch.manual_seed(0)
    w = torch.randn(5, 40, 24)
    packed = packed_linear.pack(w)
    data = packed.data
    untouched = packed.data[0].clone()
    w[1].copy_(torch.randn(40, 24))
    w[3].copy_(w[4])
    packed_linear.repack_groups(packed, w, [1, 3])
    assert packed.data is data and torch.equal(packed.data, packed_linear.pack(w).data)
    assert torch.equal(packed.data[0], untouched)
    with pytest.raises(ValueError, match="outside"):
        packed_linear.repack_groups(packed, w, [5])
    with pytest.raises(ValueError, match="does not match"):
        packed_linear.repack_groups(packed, w[:4], [0])
