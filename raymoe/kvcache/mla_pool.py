"""Rank-side KV memory for multi-head latent attention (MLA, DeepSeek-V2 paper Sec. 2.1, arXiv:2405.04434).

An MLA layer caches, per token, only the compressed latent ``c_KV`` (``kv_lora_rank`` values, after its RMSNorm)
and the rotary key ``k_pe`` (``qk_rope_head_dim`` values, after RoPE), shared by all heads, instead of full
per-head keys and values. Both live in one row ``[c_KV | k_pe]`` so that absorbed decode attends over the row as
a single-head key and over its first ``kv_lora_rank`` values as the value. The latent is replicated on every TP
rank (heads are split only after the up-projection). Slot 0 is the dummy slot, as in ``TokenToKVPool``.
"""

from __future__ import annotations

import torch


class MLATokenToKVPool:
    """Per-layer latent cache indexed by KV slot.

    ``kv_buffer[layer]``: [num_slots + 1, kv_lora_rank + qk_rope_head_dim] in ``dtype`` (row 0 = dummy slot).

    Args:
        num_slots: KV slots (tokens) without the dummy slot. num_layers: decoder layers.
        kv_lora_rank, qk_rope_head_dim: the MLA sizes (elements). dtype, device: of the buffers.
    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, num_slots: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if min(num_slots, num_layers, kv_lora_rank, qk_rope_head_dim) < 1:
            raise ValueError("num_slots, num_layers, kv_lora_rank and qk_rope_head_dim must be >= 1")
        self.num_slots = num_slots
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        shape = (num_slots + 1, kv_lora_rank + qk_rope_head_dim)
        self.kv_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> int:
        """Cache bytes one token takes on one rank: ``(kv_lora_rank + qk_rope_head_dim)`` values per layer."""
        return num_layers * (kv_lora_rank + qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()

    @property
    def buffer_bytes_per_token(self) -> int:
        """Bytes per slot actually allocated over all layers (equals :meth:`bytes_per_token`)."""
        return sum(b[0].numel() * b.element_size() for b in self.kv_buffer)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store ``latent`` [T, kv_lora_rank] and ``k_pe`` [T, qk_rope_head_dim] at slots ``loc`` [T] int64."""
        buf = self.kv_buffer[layer_id]
        buf[loc, : self.kv_lora_rank] = latent.to(self.dtype)
        buf[loc, self.kv_lora_rank:] = k_pe.to(self.dtype)

    def get_kv_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's [num_slots + 1, kv_lora_rank + qk_rope_head_dim] buffer."""
        return self.kv_buffer[layer_id]
