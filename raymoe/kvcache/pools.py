"""Rank-side KV memory: the ReqToTokenPool table and the TokenToKVPool tensors.

Ownership: the driver decides which rows and slots a request uses (``raymoe.kvcache.allocator`` /
``radix_cache``) and ships the numbers in each ``ModelWorkerBatch``; ranks only hold the tensors below and
write what they are told. Slot 0 is the dummy slot that padded rows write to.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Table of KV slots per request row.

    ``req_to_token`` [size, max_context_len] int64: entry (r, i) is the KV slot of token i of the request in row r.
    ``page_size`` (tokens): the driver's allocator keeps every aligned run of ``page_size`` positions of a row in
    one KV page, in order (``raymoe.kvcache.paged_allocator``), so position ``j * page_size`` names the page of
    the run; block-table backends rely on it (``raymoe.platform.cuda.flash_attn``). 1: no such layout.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu", page_size: int = 1):
        self.size = size
        self.max_context_len = max_context_len
        self.page_size = page_size
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)

    def write_extend(self, req_pool_indices: list[int], prefix_lens: list[int], seq_lens: list[int],
                     prefix_slots: torch.Tensor, out_cache_loc: torch.Tensor,
                     table_lens: list[int] | None = None) -> None:
        """Fill rows for an extend (or MIXED) batch: positions [table_len, prefix) from ``prefix_slots``
        (concatenated per request; ``table_lens``: positions each row already holds, default 0) and
        [prefix, seq_len) from ``out_cache_loc`` (concatenated per request)."""
        p = o = 0
        held = table_lens or [0] * len(prefix_lens)
        for row, pre, sl, tl in zip(req_pool_indices, prefix_lens, seq_lens, held, strict=True):
            if pre > tl:
                self.req_to_token[row, tl:pre] = prefix_slots[p:p + pre - tl]
                p += pre - tl
            n = sl - pre
            self.req_to_token[row, pre:sl] = out_cache_loc[o:o + n]
            o += n

    def write_decode(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """Record the slot of each request's newest token (position ``seq_len - 1``)."""
        self.req_to_token[req_pool_indices, seq_lens - 1] = out_cache_loc


class TokenToKVPool:
    """Per-layer key and value tensors indexed by KV slot.

    ``k_buffer[layer]``, ``v_buffer[layer]``: [num_slots + 1, num_kv_heads, head_dim] (row 0 = dummy slot).
    ``num_kv_heads`` is this rank's share of the kv heads.
    """

    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.num_slots = num_slots
        self.dtype = dtype
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes on one rank (keys and values of every layer)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` [T, Hkv, D] at slots ``loc`` [T] int64 of layer ``layer_id``."""
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]
