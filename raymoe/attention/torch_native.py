"""Paged attention in plain PyTorch (``scaled_dot_product_attention``); runs on any device and dtype.

Decode gathers each request's keys/values through its ReqToTokenPool row into a padded [bs, L_max] batch and
masks the padding; grouped-query heads are folded into the query-length dim so KV is never repeated. Extend runs
one SDPA call per request with a causal mask shifted by the cached prefix length. Under a decode graph
(``raymoe.runner.graph_runner``) the same decode kernel reads fixed-address index/mask buffers, refreshed in place
by the graph hooks before each replay, over the graph's KV width (``raymoe.attention.paged_graph_hooks``).

The CPU platform subclasses it with fused kernels for the store, decode and short extend requests
(``raymoe.platform.cpu.attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raymoe.attention.base import AttentionBackend
from raymoe.attention.paged_graph_hooks import PagedDecodeGraphHooks, SdpaRequest
from raymoe.kvcache.pools import ReqToTokenPool, TokenToKVPool


class TorchNativeAttnBackend(PagedDecodeGraphHooks, AttentionBackend):
    """SDPA-based paged attention.

    Args:
        req_to_token_pool: the rank's request -> slot table.
        token_to_kv_pool: the rank's KV tensors.
        num_heads, num_kv_heads: this rank's query / kv heads; head_dim: D. Scale is ``D ** -0.5``.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, num_heads: int,
                 num_kv_heads: int, head_dim: int):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.kv_indices: torch.Tensor | None = None
        self.kv_mask: torch.Tensor | None = None
        self.extend_requests: list[SdpaRequest] = []

    def sdpa_extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, s: SdpaRequest) -> torch.Tensor:
        """Request ``s``'s attention over its gathered keys/values: [ext, Hq, D]."""
        qi = q[s.start:s.start + s.ext].transpose(0, 1).unsqueeze(0)        # [1, Hq, ext, D]
        ki = k_buf[s.slots].transpose(0, 1).unsqueeze(0).to(q.dtype)        # [1, Hkv, L, D]
        vi = v_buf[s.slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=s.mask, enable_gqa=self.group > 1)
        return o[0].transpose(0, 1)

    def forward_extend(self, q, k, v, layer_id, forward_batch):
        """Extend attention: ``q`` [T, Hq, D], ``k``/``v`` [T, Hkv, D] (written to ``out_cache_loc`` first) ->
        [T, Hq, D], one SDPA call per request over its gathered keys/values with a causal mask shifted by its
        cached prefix."""
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        out = torch.empty_like(q)
        for s in self.extend_requests:
            out[s.start:s.start + s.ext] = self.sdpa_extend(q, k_buf, v_buf, s)
        return out

    def forward_decode(self, q, k, v, layer_id, forward_batch):
        """Decode attention: ``q`` [bs, Hq, D], ``k``/``v`` [bs, Hkv, D] (written to ``out_cache_loc`` first)
        -> [bs, Hq, D]; keys/values of each row are gathered over ``kv_indices`` [bs, L] and masked by
        ``kv_mask``."""
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        bs = q.shape[0]
        idx = self.kv_indices.reshape(-1)  # index_select is far faster than advanced indexing on CPU
        shape = (*self.kv_indices.shape, self.num_kv_heads, self.head_dim)
        keys, values = self.gather(k_buf, v_buf, idx)
        keys = keys.view(shape).transpose(1, 2).to(q.dtype)      # [bs, Hkv, L, D]
        values = values.view(shape).transpose(1, 2).to(q.dtype)
        qg = q.view(bs, self.num_kv_heads, self.group, self.head_dim)     # [bs, Hkv, G, D]
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=self.kv_mask)
        return o.reshape(bs, self.num_heads, self.head_dim)

    def gather(self, k_buf: torch.Tensor, v_buf: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``idx`` [N] of ``k_buf``/``v_buf`` [slots, Hkv, D] -> two [N, Hkv, D] tensors (fresh: a CUDA graph
        must own what it reads, and the caching allocator makes them cheap)."""
        return k_buf.index_select(0, idx), v_buf.index_select(0, idx)

