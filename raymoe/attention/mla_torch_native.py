"""Paged multi-head latent attention (MLA) in plain PyTorch over an ``MLATokenToKVPool``; CPU and GPU.

The cache row of a token is ``[c_KV | k_pe]`` (``raymoe.kvcache.mla_pool``). Two forms (DeepSeek-V2 paper
Sec. 2.1, arXiv:2405.04434, and its appendix on weight absorption):

* **Extend** (non-absorbed, "MHA" form): every request's cached rows (radix-hit prefix and this step's tokens) are
  up-projected by the layer's ``expand_kv`` into per-head keys ``[k_nope | k_pe]`` and values, then causal SDPA with
  the prefix shift. Cheap when queries are many and the prefix is short.
* **Decode** (weight-absorbed, "MQA" form): the layer folds ``W_UK`` into the queries, so a query is
  ``[q_nope W_UK | q_pe]`` (``kv_lora_rank + qk_rope_head_dim`` values per head) and attends over the cache rows as
  one shared key head; the value is the latent part of the row. The output stays in latent space (``kv_lora_rank``
  per head) and the layer applies ``W_UV``. No per-head K/V is ever materialized for the cached tokens.

Metadata and graph hooks follow ``raymoe.attention.torch_native`` (index/mask buffers of fixed address for decode
graphs, refreshed in place before each replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from raymoe.attention.base import AttentionBackend
from raymoe.attention.paged_graph_hooks import PagedDecodeGraphHooks
from raymoe.kvcache.mla_pool import MLATokenToKVPool
from raymoe.kvcache.pools import ReqToTokenPool

ExpandKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class TorchNativeMLABackend(PagedDecodeGraphHooks, AttentionBackend):
    """SDPA-based paged MLA.

    Args:
        req_to_token_pool: the rank's request -> slot table.
        token_to_kv_pool: the rank's latent cache.
        num_heads: this rank's query heads.
        softmax_scale: attention scale (``MLAConfig.softmax_scale``, YaRN mscale included).
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MLATokenToKVPool, num_heads: int,
                 softmax_scale: float):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.num_heads = num_heads
        self.kv_lora_rank = token_to_kv_pool.kv_lora_rank
        self.scale = softmax_scale
        self.kv_indices: torch.Tensor | None = None
        self.kv_mask: torch.Tensor | None = None
        self.extend_requests = []

    def _store(self, layer_id: int, forward_batch, rows: torch.Tensor) -> torch.Tensor:
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, rows[:, : self.kv_lora_rank],
                                   rows[:, self.kv_lora_rank:])
        return self.kv_pool.get_kv_buffer(layer_id)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: ExpandKV, layer_id: int,
                       forward_batch) -> torch.Tensor:
        """Non-absorbed causal attention over each request's prefix and new tokens.

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
        for req in self.extend_requests:
            start, ext, slots, mask = req.start, req.ext, req.slots, req.mask
            keys, values = v(buf[slots].to(q.dtype))
            qi = q[start:start + ext].transpose(0, 1).unsqueeze(0)                       # [1, H, ext, Dqk]
            o = F.scaled_dot_product_attention(qi, keys.transpose(0, 1).unsqueeze(0),
                                               values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=self.scale)
            if out is None:
                out = q.new_empty((q.shape[0], q.shape[1], values.shape[-1]))
            out[start:start + ext] = o[0].transpose(0, 1)
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: object, layer_id: int,
                       forward_batch) -> torch.Tensor:
        """Weight-absorbed decode: one query per request over its cache rows as a single shared key head.

        Args:
            q: [bs, H, kv_lora_rank + qk_rope] absorbed queries ``[q_nope W_UK | q_pe]``.
            k: [bs, kv_lora_rank + qk_rope] the new token's cache row, stored at ``out_cache_loc``.
            v: unused (the values are the latent part of the cached rows).
        Returns:
            [bs, H, kv_lora_rank] attention output in latent space.
        """
        buf = self._store(layer_id, forward_batch, k)
        bs = q.shape[0]
        rows = buf.index_select(0, self.kv_indices.reshape(-1)).view(bs, 1, self.kv_indices.shape[1], -1)
        rows = rows.to(q.dtype)                                                           # [bs, 1, L, Dc]
        o = F.scaled_dot_product_attention(q.unsqueeze(1), rows, rows[..., : self.kv_lora_rank],
                                           attn_mask=self.kv_mask, scale=self.scale)    # [bs, 1, H, Dl]
        return o.squeeze(1)

    def forward(self, q, k, v, layer_id, forward_batch) -> torch.Tensor:
        """Dispatch on the mode; an IDLE batch returns an empty [0, H, 0] tensor (the layer reshapes it)."""
        if forward_batch.forward_mode.is_idle() or q.shape[0] == 0:
            return q.new_empty((0, q.shape[1], 0))
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer_id, forward_batch)
        return self.forward_extend(q, k, v, layer_id, forward_batch)
