"""Offline-throughput kernels give the results of their plain versions: grouped expert GEMMs vs the per-expert
loop (random routing, empty experts, zero rows), the chunked greedy argmax vs ``torch.argmax`` (ties, NaN, odd
vocabularies), and decode attention through the reused CPU gather buffers vs SDPA over freshly gathered keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raymoe.comm.groups import ParallelGroups
from raymoe.kvcache.pools import ReqToTokenPool, TokenToKVPool
from raymoe.layers.moe import LocalExperts
from raymoe.platform.cpu.attention import CpuPagedAttnBackend
from raymoe.platform.cpu.kernels import build
from raymoe.platform.selector import reference_platform, select_platform
from raymoe.step.forward_mode import ForwardMode

CPU = select_platform("cpu")
REF = reference_platform()
greedy_argmax = CPU.greedy_argmax


def _experts(dtype: torch.dtype, num_experts: int = 8, hidden: int = 32, inter: int = 16) -> LocalExperts:
    g = torch.Generator().manual_seed(0)
    ex = LocalExperts(num_experts, hidden, inter, ParallelGroups.single(), dtype, REF)
    ex.w13.data.copy_(torch.randn(ex.w13.shape, generator=g) * 0.1)
    ex.w2.data.copy_(torch.randn(ex.w2.shape, generator=g) * 0.1)
    return ex


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,used", [(1, 8), (7, 2), (64, 8), (300, 3), (513, 1)])
def test_grouped_experts_equal_the_loop(dtype, rows, used):
    """Same rows as the per-expert loop, bit for bit, with only ``used`` of 8 experts routed to (the rest
    empty) and ids in random order."""
    ex = _experts(dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 32, generator=g).to(dtype)
    allowed = torch.randperm(8, generator=g)[:used]
    ids = allowed[torch.randint(0, used, (rows,), generator=g)]
    assert torch.equal(REF.expert_rows(x, ids, ex), REF._expert_loop(x, ids, ex))
    assert torch.equal(ex(x, ids), REF._expert_loop(x, ids, ex))


def test_experts_zero_rows_and_float64_fallback():
    ex = _experts(torch.float32)
    assert ex(torch.empty(0, 32), torch.empty(0, dtype=torch.int64)).shape == (0, 32)
    ex64 = _experts(torch.float64)
    x = torch.randn(9, 32, dtype=torch.float64)
    ids = torch.tensor([3, 3, 0, 7, 7, 7, 1, 3, 0])
    ref = torch.stack([F.linear(F.silu(a) * b, ex64.w2[e]) for e, (a, b) in
                       ((int(e), F.linear(x[i], ex64.w13[int(e)]).chunk(2)) for i, e in enumerate(ids))])
    assert torch.allclose(ex64(x, ids), ref, atol=1e-12)


@pytest.mark.parametrize("shape", [(1, 128), (5, 256), (64, 8192), (3, 1000), (4, 2048)])
def test_greedy_argmax_matches_argmax(shape):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g)
    assert torch.equal(greedy_argmax(x), torch.argmax(x, dim=-1))


def test_greedy_argmax_ties_nan_and_views():
    x = torch.zeros(4, 1024)
    x[0, [700, 5, 900]] = 1.0                   # ties across chunks: the first wins
    x[1, [130, 129]] = 2.0                      # ties inside a chunk
    x[2, 1023] = float("inf")
    x[3, [300, 10]] = float("nan")              # argmax takes NaN as the maximum
    assert greedy_argmax(x).tolist() == torch.argmax(x, dim=-1).tolist() == [5, 129, 1023, 10]
    wide = torch.randn(3, 2048)
    view = wide[:, :1024]                       # non-contiguous rows (e.g. logits cut to the vocabulary)
    assert torch.equal(greedy_argmax(view), torch.argmax(view, dim=-1))
    half = torch.randn(6, 512).bfloat16()
    assert torch.equal(greedy_argmax(half), torch.argmax(half, dim=-1))
    assert greedy_argmax(torch.empty(0, 256)).shape == (0,)


class _Decode:
    """The fields of a decode ForwardBatch that the attention backend reads."""

    def __init__(self, rows: list[int], seq_lens: list[int], out_loc: torch.Tensor):
        self.forward_mode = ForwardMode.DECODE
        self.batch_size = len(rows)
        self.req_pool_indices = torch.tensor(rows)
        self.seq_lens = torch.tensor(seq_lens)
        self.seq_lens_cpu = list(seq_lens)
        self.out_cache_loc = out_loc


@pytest.mark.parametrize("fused", [False, True])
def test_decode_attention_reuses_gather_buffers_without_stale_rows(fused):
    """Batches of different sizes and widths through one backend (its buffers grow and are reused across
    layers and steps) equal SDPA over keys gathered afresh; with the fused CPU kernels off (the gather path) and
    on (``raymoe.platform.cpu.kernels.cpu_ops.decode_attention``, no gather), through the CPU platform's backend."""
    if fused and build.load() is None:
        pytest.skip("fused CPU kernels unavailable (no C compiler, or RAYMOE_CPU_KERNELS=0)")
    build.reset(enabled=fused)
    try:
        _check_decode_attention()
    finally:
        build.reset()


def _check_decode_attention():
    hq, hkv, d, ctx, layers = 4, 2, 8, 40, 2
    req_pool = ReqToTokenPool(16, ctx)
    kv = TokenToKVPool(16 * ctx, layers, hkv, d, torch.float32, "cpu")
    backend = CpuPagedAttnBackend(req_pool, kv, hq, hkv, d)
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        k_buf, v_buf = kv.get_kv_buffer(layer)
        k_buf.copy_(torch.randn(k_buf.shape, generator=g))
        v_buf.copy_(torch.randn(v_buf.shape, generator=g))
    req_pool.req_to_token.copy_(torch.randperm(16 * ctx, generator=g)[:16 * ctx].view(16, ctx) + 1)
    for rows, lens in (([0, 1, 2], [30, 5, 12]), (list(range(10)), [3 + 3 * i for i in range(10)]), ([4], [2])):
        out_loc = req_pool.req_to_token[rows, [n - 1 for n in lens]]
        fb = _Decode(rows, lens, out_loc)
        backend.init_forward_metadata(fb)
        for layer in range(layers):
            q = torch.randn(len(rows), hq, d, generator=g)
            k = torch.randn(len(rows), hkv, d, generator=g)
            v = torch.randn(len(rows), hkv, d, generator=g)
            got = backend.forward_decode(q, k, v, layer, fb)
            k_buf, v_buf = kv.get_kv_buffer(layer)
            for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
                slots = req_pool.req_to_token[row, :n]
                ref = F.scaled_dot_product_attention(q[i].unsqueeze(1), k_buf[slots].transpose(0, 1),
                                                     v_buf[slots].transpose(0, 1), enable_gqa=True)
                assert torch.allclose(got[i], ref.squeeze(1), atol=1e-5)
