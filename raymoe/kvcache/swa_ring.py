"""Sliding-window layers' KV in a ring per request row (``swa_kv_eviction``; gpt-oss's ``sliding_attention`` layers).

A query at position ``p`` of a layer with window ``W`` reads keys at positions ``p - W < k <= p`` only, so such a
layer never needs more than the last ``W`` positions of a request. With ``swa_kv_eviction`` these layers keep no
KV in the token pool (it holds the full-attention layers only, so every token costs half the bytes on gpt-oss,
whose layers alternate); each ReqToTokenPool row owns a ring of ``R = W + slack`` slots per sliding layer instead,
and position ``p`` of the request in row ``r`` lives at slot ``1 + r * R + p mod R`` (slot 0: the dummy that padding
rows write). A position is evicted when position ``p + R`` is written over it; with ``slack = 0`` that is exactly
when no later query can read it. Speculative decoding needs ``slack = k`` (drafts per request and step): a verify
step writes its ``k`` drafts before it knows which are rejected, and draft ``j`` lands on the slot of position
``p + j - R``, which the next step's window must still hold unless ``R >= W + k``; the rejected positions are
written again by the tokens that take them. The ring costs ``rows x R`` slots per sliding layer whatever the
requests' lengths; SGLang's
``SWATokenToKVPool`` frees sliding-window slots through a second allocator instead (and keeps radix hits, which a
ring cannot serve: the engine switches them off with this option).

Which positions a step may overwrite is the attention backend's business (``raymoe.attention.swa_ring``): decode
writes the new position, then reads the window it closes; extend reads the ring's part of the window before it
writes the chunk's last ``W`` positions.
"""

from __future__ import annotations

import torch


class SlidingWindowRing:
    """Per-row rings of K/V for the sliding-window layers (module docstring).

    ``k_buffer[i]``, ``v_buffer[i]``: [rows * size + 1, Hkv, D] for sliding layer ``i`` (the model's sliding
    layers in order; row 0: the dummy slot), ``size = window + slack``.

    Args:
        rows: ReqToTokenPool rows. window: the layers' window (tokens, >= 1). num_layers: sliding layers.
        num_kv_heads, head_dim: this rank's kv heads and their size. dtype, device: of the buffers.
        slack: positions a step may write past the last one it keeps (speculative drafts per request; 0 without).
    Raises:
        ValueError: a size below 1, or a negative slack.
    """

    def __init__(self, rows: int, window: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", slack: int = 0):
        if min(rows, window, num_layers, num_kv_heads, head_dim) < 1 or slack < 0:
            raise ValueError(f"ring sizes must be >= 1 (slack >= 0): rows={rows}, window={window}, "
                             f"layers={num_layers}, slack={slack}")
        self.rows, self.window, self.num_layers = rows, window, num_layers
        self.size = window + slack
        shape = (rows * self.size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Ring slots of ``positions`` (int64, any shape; negative positions wrap, callers mask them) of the
        requests in ``rows`` (int64, broadcastable to ``positions``)."""
        return 1 + rows * self.size + positions.remainder(self.size)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` [N, Hkv, D] at ring ``slots`` [N] int64 (no slot twice) of sliding layer ``layer``."""
        self.k_buffer[layer][slots] = k.to(self.k_buffer[layer].dtype)
        self.v_buffer[layer][slots] = v.to(self.v_buffer[layer].dtype)

    def nbytes(self) -> int:
        """Bytes of every ring buffer (all rows, keys and values)."""
        return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))
