"""Paged multi-head latent attention (MLA) in plain PyTorch over an ``MLATokenToKVPool``; CPU and GPU.

The cache row of a token is ``[c_KV | k_pe]`` (``raymoe.kvcache.mla_pool``). Two forms (DeepSeek-V2 paper
Sec. 2.1, arXiv:2405.04434, and its appendix on weight absorption):

* **Extend** (non-absorbed, "MHA" form): the step's requests are packed into tiles of flattened tokens
  (``raymoe.attention.mla_extend_tiles``); each tile's cached rows (radix-hit prefixes and this step's tokens) are
  gathered and up-projected once by the layer's ``expand_kv`` into per-head keys ``[k_nope | k_pe]`` and values,
  then one SDPA call with the tile's block-diagonal causal mask. Cheap when queries are many and prefixes short.
* **Decode** (weight-absorbed, "MQA" form): the layer folds ``W_UK`` into the queries, so a query is
  ``[q_nope W_UK | q_pe]`` (``kv_lora_rank + qk_rope_head_dim`` values per head) and attends over the cache rows as
  one shared key head; the value is the latent part of the row. The output stays in latent space (``kv_lora_rank``
  per head) and the layer applies ``W_UV``. No per-head K/V is ever materialized for the cached tokens. The rows
  are read over the step's ``kv_indices`` [bs, L] (L: the longest sequence, or the decode graph's KV width): up to
  ``kv_chunk`` tokens in one gather and one SDPA call; a wider step loops over chunks of ``kv_chunk`` tokens with
  an online softmax (running max and sum in float32, as FlashAttention, Dao et al. 2022, and Milakov & Gimelshein
  2018), so the gathered rows never exceed ``bs x kv_chunk`` whatever the table width.

Decode metadata and graph hooks follow ``raymoe.attention.torch_native`` (index/mask buffers of fixed address for
decode graphs, refreshed in place before each replay, read up to the graph's KV width).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from raymoe.attention.base import AttentionBackend
from raymoe.attention.mla_extend_tiles import MAX_TILE_ELEMS, ExtendTile, build_tiles
from raymoe.attention.paged_graph_hooks import PagedDecodeGraphHooks
from raymoe.kvcache.mla_pool import MLATokenToKVPool
from raymoe.kvcache.pools import ReqToTokenPool

ExpandKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

DECODE_KV_CHUNK = 256
"""Tokens of cache rows a decode step gathers at once (module docstring)."""


class TorchNativeMLABackend(PagedDecodeGraphHooks, AttentionBackend):
    """SDPA-based paged MLA.

    Args:
        req_to_token_pool: the rank's request -> slot table.
        token_to_kv_pool: the rank's latent cache.
        num_heads: this rank's query heads.
        softmax_scale: attention scale (``MLAConfig.softmax_scale``, YaRN mscale included).
        kv_chunk: decode gathers at most this many tokens per row at once (module docstring).
        max_tile_elems: extend tile budget, query x key tokens (``raymoe.attention.mla_extend_tiles``).
    Raises:
        ValueError: ``kv_chunk`` or ``max_tile_elems`` below 1.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MLATokenToKVPool, num_heads: int,
                 softmax_scale: float, kv_chunk: int = DECODE_KV_CHUNK, max_tile_elems: int = MAX_TILE_ELEMS):
        if kv_chunk < 1 or max_tile_elems < 1:
            raise ValueError(f"kv_chunk ({kv_chunk}) and max_tile_elems ({max_tile_elems}) must be >= 1")
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.num_heads = num_heads
        self.kv_lora_rank = token_to_kv_pool.kv_lora_rank
        self.scale = softmax_scale
        self.kv_indices: torch.Tensor | None = None
        self.kv_mask: torch.Tensor | None = None
        self.kv_chunk = kv_chunk
        self.max_tile_elems = max_tile_elems
        self.extend_tiles: list[ExtendTile] = []

    def init_extend_metadata(self, fb) -> None:
        """The step's :class:`ExtendTile` list (``raymoe.attention.mla_extend_tiles.build_tiles``)."""
        self.extend_tiles = build_tiles(self.req_to_token, fb.req_pool_indices_cpu, fb.extend_lens_cpu,
                                        fb.prefix_lens_cpu, fb.seq_lens_cpu, self.max_tile_elems)

    def _store(self, layer_id: int, forward_batch, rows: torch.Tensor) -> torch.Tensor:
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, rows[:, : self.kv_lora_rank],
                                   rows[:, self.kv_lora_rank:])
        return self.kv_pool.get_kv_buffer(layer_id)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: ExpandKV, layer_id: int,
                       forward_batch) -> torch.Tensor:
        """Non-absorbed causal attention over each request's prefix and new tokens, one SDPA call per tile of
        requests (each tile's cached rows gathered and up-projected once).

        Args:
            q: [T, H, qk_nope + qk_rope] full queries (rotary part already rotated).
            k: [T, kv_lora_rank + qk_rope] this step's cache rows ``[c_KV | k_pe]``, stored at ``out_cache_loc``.
            v: the layer's ``expand_kv``: rows [N, kv_lora_rank + qk_rope] -> (keys [N, H, qk_nope + qk_rope],
                values [N, H, v_head_dim]).
        Returns:
            [T, H, v_head_dim].
        """
        buf = self._store(layer_id, forward_batch, k)
        out = None
        for tile in self.extend_tiles:
            keys, values = v(buf.index_select(0, tile.slots).to(q.dtype))                 # [S, H, *]
            qt = q[tile.q_start:tile.q_end].transpose(0, 1).unsqueeze(0)                 # [1, H, Tq, Dqk]
            o = F.scaled_dot_product_attention(qt, keys.transpose(0, 1).unsqueeze(0),
                                               values.transpose(0, 1).unsqueeze(0), attn_mask=tile.mask,
                                               scale=self.scale)
            if out is None:
                out = q.new_empty((q.shape[0], q.shape[1], values.shape[-1]))
            out[tile.q_start:tile.q_end] = o[0].transpose(0, 1)
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: object, layer_id: int,
                       forward_batch) -> torch.Tensor:
        """Weight-absorbed decode: one query per request over its cache rows as a single shared key head, over
        ``kv_indices`` [bs, L]: one gather and SDPA call when L <= ``kv_chunk``, else :meth:`decode_chunked`.

        Args:
            q: [bs, H, kv_lora_rank + qk_rope] absorbed queries ``[q_nope W_UK | q_pe]``.
            k: [bs, kv_lora_rank + qk_rope] the new token's cache row, stored at ``out_cache_loc``.
            v: unused (the values are the latent part of the cached rows).
        Returns:
            [bs, H, kv_lora_rank] attention output in latent space.
        """
        return self.attend_decode(q, self._store(layer_id, forward_batch, k))

    def attend_decode(self, q: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """The absorbed attention of :meth:`forward_decode` over the layer's cache ``buf`` [slots, Dc] (its new rows
        stored): one gather and SDPA when ``kv_indices`` is at most ``kv_chunk`` wide, else chunks. A platform's
        backend may compute it otherwise (``raymoe.platform.cpu.mla_attention``)."""
        if self.kv_indices.shape[1] <= self.kv_chunk:
            return self._decode_sdpa(q, buf)
        return self.decode_chunked(q, buf)

    def _decode_sdpa(self, q: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """One gather of ``kv_indices`` [bs, L] and one SDPA call: [bs, H, Dc] queries -> [bs, H, kv_lora_rank]."""
        bs = q.shape[0]
        rows = buf.index_select(0, self.kv_indices.reshape(-1)).view(bs, 1, self.kv_indices.shape[1], -1)
        rows = rows.to(q.dtype)                                                       # [bs, 1, L, Dc]
        o = F.scaled_dot_product_attention(q.unsqueeze(1), rows, rows[..., : self.kv_lora_rank],
                                           attn_mask=self.kv_mask, scale=self.scale)  # [bs, 1, H, Dl]
        return o.squeeze(1)

    def decode_chunked(self, q: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Absorbed decode over ``kv_indices`` in chunks of ``kv_chunk`` tokens with an online softmax.

        Args:
            q: [bs, H, Dc] absorbed queries (Dc = kv_lora_rank + qk_rope). buf: the layer's cache [slots, Dc].
        Returns:
            [bs, H, kv_lora_rank] in ``q.dtype``; the softmax statistics and the accumulator are float32 (float64
            for float64 queries), the products run in ``q.dtype``. Every row attends to its first slot at least
            (a padding row's seq_len is 1), so the running max is finite after the first chunk.
        """
        bs, width, lora = q.shape[0], self.kv_indices.shape[1], self.kv_lora_rank
        visible = self.kv_mask.view(bs, width)
        stat = torch.promote_types(q.dtype, torch.float32)
        top = torch.full((bs, q.shape[1], 1), float("-inf"), dtype=stat, device=q.device)
        total = torch.zeros_like(top)
        acc = torch.zeros((bs, q.shape[1], lora), dtype=stat, device=q.device)
        for s in range(0, width, self.kv_chunk):
            e = min(s + self.kv_chunk, width)
            rows = buf.index_select(0, self.kv_indices[:, s:e].reshape(-1)).view(bs, e - s, -1).to(q.dtype)
            scores = torch.bmm(q, rows.transpose(1, 2)).to(stat) * self.scale                # [bs, H, c]
            scores.masked_fill_(~visible[:, None, s:e], float("-inf"))
            new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
            safe = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
            p = torch.exp(scores - safe)
            rescale = torch.exp(top - safe)
            total = total * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + torch.bmm(p.to(q.dtype), rows[..., :lora]).to(stat)
            top = new_top
        return (acc / total).to(q.dtype)

    verify_as_decode = True  # TARGET_VERIFY: absorbed decode rows, one per token (PagedDecodeGraphHooks)

    def forward(self, q, k, v, layer_id, forward_batch) -> torch.Tensor:
        """Dispatch on the mode; an IDLE batch returns an empty [0, H, 0] tensor (the layer reshapes it)."""
        mode = forward_batch.forward_mode
        if mode.is_idle() or q.shape[0] == 0:
            return q.new_empty((0, q.shape[1], 0))
        if mode.is_decode() or mode.is_target_verify():
            return self.forward_decode(q, k, v, layer_id, forward_batch)
        return self.forward_extend(q, k, v, layer_id, forward_batch)
