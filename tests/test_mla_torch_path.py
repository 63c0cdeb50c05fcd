"""The torch MLA backend's two shapes of work without the blow-ups: extend tiles (flattened tokens with a
block-diagonal causal mask) against per-request masks, and the chunked decode (online softmax) against the one-gather
SDPA decode, at a graph width far above the sequences. Engine-level parity is in ``test_deepseek_parity``."""

from __future__ import annotations

import pytest
import torch

from raymoe.attention.mla_extend_tiles import ExtendTile, build_tiles, pack_tiles
from raymoe.attention.mla_torch_native import TorchNativeMLABackend
from raymoe.kvcache.mla_pool import MLATokenToKVPool
from raymoe.kvcache.pools import ReqToTokenPool


def test_pack_tiles_keeps_each_tile_within_the_budget():
    ext, seq = [3, 1, 1, 40, 2], [3, 10, 12, 45, 9]
    assert pack_tiles(ext, seq, max_tile_elems=10 ** 6) == [range(0, 5)]
    tiles = pack_tiles(ext, seq, max_tile_elems=130)   # (3+1+1) x (3+10+12) = 125
    assert tiles == [range(0, 3), range(3, 4), range(4, 5)]        # request 3 alone exceeds the budget
    assert [i for t in tiles for i in t] == list(range(5))
    with pytest.raises(ValueError, match="extend length 0"):
        pack_tiles([0], [4])
    with pytest.raises(ValueError, match="extend length 5"):
        pack_tiles([5], [4])


def test_tile_masks_equal_the_per_request_causal_masks():
    g = torch.Generator().manual_seed(0)
    table = torch.randint(1, 1000, (4, 32), generator=g)
    rows, ext, pre = [2, 0, 3], [3, 1, 4], [5, 7, 0]
    seq = [p + e for p, e in zip(pre, ext, strict=True)]
    (tile,) = build_tiles(table, rows, ext, pre, seq)
    assert (tile.q_start, tile.q_end) == (0, 8) and tuple(tile.mask.shape) == (8, sum(seq))
    q0, k0 = 0, 0
    for r, e, p, s in zip(rows, ext, pre, seq, strict=True):
        assert torch.equal(tile.slots[k0:k0 + s], table[r, :s])
        want = torch.arange(s)[None, :] <= torch.arange(p, s)[:, None]
        assert torch.equal(tile.mask[q0:q0 + e, k0:k0 + s], want)
        assert not tile.mask[q0:q0 + e, :k0].any() and not tile.mask[q0:q0 + e, k0 + s:].any()
        q0, k0 = q0 + e, k0 + s
    single = build_tiles(table, rows, ext, pre, seq, max_tile_elems=1)
    assert [(t.q_start, t.q_end) for t in single] == [(0, 3), (3, 4), (4, 8)]
    assert single[1].mask is None and torch.equal(single[2].slots, table[3, :4])
    with pytest.raises(ValueError, match="prefix 5"):
        build_tiles(table, [2], [3], [5], [9])
    with pytest.raises(ValueError, match="does not match"):
        ExtendTile(0, 2, torch.zeros(3, dtype=torch.int64), torch.ones(2, 2, dtype=torch.bool))


class _Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_idle(self):
        return False


class _Batch:
    """The fields of a ForwardBatch the backend reads for a decode step."""

    def __init__(self, rows, seq_lens, out_cache_loc):
        self.forward_mode = _Mode(True)
        self.batch_size = len(rows)
        self.req_pool_indices = torch.tensor(rows)
        self.seq_lens = torch.tensor(seq_lens)
        self.seq_lens_cpu = list(seq_lens)
        self.out_cache_loc = out_cache_loc


def _decode_case(dtype, seq_lens, width=512, heads=4, lora=32, rope=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    slots = sum(seq_lens) + 8
    pool = MLATokenToKVPool(slots, 1, lora, rope, dtype)
    pool.kv_buffer[0].copy_(torch.randn(slots + 1, lora + rope, generator=g))
    rtt = ReqToTokenPool(bs + 1, width)
    perm = torch.randperm(slots, generator=g) + 1
    used = 0
    for r, n in enumerate(seq_lens):
        rtt.req_to_token[r, :n] = perm[used:used + n]
        used += n
    q = torch.randn(bs, heads, lora + rope, generator=g).to(dtype)
    new = torch.randn(bs, lora + rope, generator=g).to(dtype)
    loc = torch.stack([rtt.req_to_token[r, n - 1] for r, n in enumerate(seq_lens)])
    return pool, rtt, q, new, _Batch(list(range(bs)), seq_lens, loc)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_chunked_decode_at_a_wide_graph_width_equals_the_one_gather_decode(dtype, tol):
    """A decode graph over the whole 512-token table width, rows of 3..300 tokens and a padding row (seq_len 1):
    chunks of 64 tokens with the online softmax give the one-gather SDPA result; the chunked path never gathers
    more than bs x 64 rows at once."""
    seq_lens = [3, 300, 77, 1, 129]
    pool, rtt, q, new, fb = _decode_case(dtype, seq_lens)
    outs = {}
    for chunk in (512, 64):
        be = TorchNativeMLABackend(rtt, pool, num_heads=4, softmax_scale=0.17, kv_chunk=chunk)
        be.init_cuda_graph_state(max_bs=8, max_kv_len=512)
        be.init_forward_metadata_replay_cuda_graph(len(seq_lens), fb.req_pool_indices, fb.seq_lens, seq_lens,
                                                   fb.forward_mode, kv_width=512)
        assert tuple(be.kv_indices.shape) == (5, 512)
        outs[chunk] = be.forward(q, new, None, 0, fb)
    assert outs[64].dtype == dtype and outs[64].shape == (5, 4, 32)
    assert (outs[64].float() - outs[512].float()).abs().max().item() < tol
    # the reference: per row, softmax over its first seq_len rows in float64
    buf = pool.kv_buffer[0].double()
    for r, n in enumerate(seq_lens):
        rows = buf[rtt.req_to_token[r, :n]]
        p = torch.softmax(q[r].double() @ rows.T * 0.17, dim=-1)
        assert (outs[64][r].double() - p @ rows[:, :32]).abs().max().item() < tol


def test_chunked_decode_gathers_at_most_a_chunk_per_call(monkeypatch):
    seq_lens = [200, 5, 90]
    pool, rtt, q, new, fb = _decode_case(torch.float32, seq_lens)
    be = TorchNativeMLABackend(rtt, pool, num_heads=4, softmax_scale=0.2, kv_chunk=32)
    be.init_forward_metadata(fb)
    assert tuple(be.kv_indices.shape) == (3, 200)       # eager: the longest sequence, not the table width
    sizes = []
    real = torch.Tensor.index_select

    def spy(self, dim, index):
        sizes.append(index.numel())
        return real(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    be.forward(q, new, None, 0, fb)
    assert sizes and max(sizes) <= 3 * 32 and sum(sizes) == 3 * 200
