"""Attention for a model whose sliding-window layers keep their KV in per-row rings (``swa_kv_eviction``:
``raymoe.kvcache.swa_ring``), the other layers in the token pool.

:class:`SwaRingAttnBackend` wraps the platform's backend built over the full-attention layers only (their own
layer numbering in the token pool; on CUDA ``flash_attn``, else the torch reference with sinks) and answers the
sliding layers itself, in plain torch on the rank's device, with the layer's attention sinks:

* **Decode** (and decode graphs: no host reads, fixed shapes): each row writes its new position ``p`` to its ring
  (a padding row, whose ``out_cache_loc`` is the dummy slot 0, writes ring slot 0), then attends over the window
  ``p - W + 1 .. p``: ``[bs, W]`` ring slots gathered, positions below 0 masked.
* **Extend / MIXED** (eager): per request, the keys of positions ``max(0, pre - W + 1) .. pre - 1`` are read from
  the ring before anything is written, the chunk's own keys are taken as computed, a causal window mask joins them;
  then the chunk's last ``min(n, R)`` positions are written (``R``: the ring's size). So a chunk longer than the
  window never overwrites a key one of its own queries reads. TARGET_VERIFY rows (a newest token and its drafts)
  take this path too; the ring's slack keeps rejected drafts off the next window.

Every other step the wrapped backend runs as it would (its metadata, its decode graph hooks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raymoe.attention.base import AttentionBackend
from raymoe.attention.sink_window import sink_softmax_attention
from raymoe.kvcache.swa_ring import SlidingWindowRing


class SwaRingAttnBackend(AttentionBackend):
    """Full-attention layers through ``inner``, sliding layers through ``ring`` (module docstring).

    Args:
        inner: the platform's backend over the token pool of the full-attention layers (numbered 0..F-1 there).
        ring: the sliding layers' rings (numbered 0..S-1 there).
        sliding: per decoder layer, whether it is a sliding-window layer (``ring.window`` tokens).
        sinks: per decoder layer, its [num_heads] sink logits or None (the sliding layers' are used here).
        num_heads, num_kv_heads, head_dim: this rank's query / kv heads and their size.
    Raises:
        ValueError: ``sliding`` and ``sinks`` differ in length, or the ring's layer count is not the number of
            sliding layers.
    """

    def __init__(self, inner: AttentionBackend, ring: SlidingWindowRing, sliding: Sequence[bool],
                 sinks: Sequence[torch.Tensor | None], num_heads: int, num_kv_heads: int, head_dim: int):
        if len(sliding) != len(sinks):
            raise ValueError(f"{len(sliding)} layer kinds for {len(sinks)} layers of sinks")
        if sum(sliding) != ring.num_layers:
            raise ValueError(f"{sum(sliding)} sliding layers for a ring of {ring.num_layers}")
        self.inner, self.ring, self.sinks = inner, ring, tuple(sinks)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group, self.scale = num_heads // num_kv_heads, head_dim ** -0.5
        full = swa = 0
        self.index: list[tuple[bool, int]] = []  # per decoder layer: (sliding, its index in the ring or the pool)
        for s in sliding:
            self.index.append((bool(s), swa if s else full))
            swa, full = swa + bool(s), full + (not s)
        self._extend: list[tuple[int, int, int, int]] = []  # per request: (row, prefix, seq_len, extend_len)

    # ---- per step ----
    def init_forward_metadata(self, forward_batch) -> None:
        """The wrapped backend's metadata, and for extend / MIXED steps each request's row and lengths."""
        self.inner.init_forward_metadata(forward_batch)
        fb = forward_batch
        if fb.forward_mode.is_idle() or fb.forward_mode.is_decode():
            self._extend = []
        else:
            self._extend = list(zip(fb.req_pool_indices_cpu, fb.prefix_lens_cpu, fb.seq_lens_cpu, fb.extend_lens_cpu,
                                    strict=True))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                forward_batch) -> torch.Tensor:
        sliding, index = self.index[layer_id]
        if not sliding:
            return self.inner.forward(q, k, v, index, forward_batch)
        return super().forward(q, k, v, layer_id, forward_batch)

    def forward_extend(self, q, k, v, layer_id, forward_batch):
        """A sliding layer's extend (module docstring): q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        sliding, li = self.index[layer_id]
        if not sliding:
            return self.inner.forward_extend(q, k, v, li, forward_batch)
        ring, w, dev = self.ring, self.ring.window, q.device
        kb, vb = ring.k_buffer[li], ring.v_buffer[li]
        out = torch.empty_like(q)
        t0 = 0
        for row, pre, sl, n in self._extend:
            kstart = max(0, pre - w + 1)
            old = ring.slots(torch.tensor(row, device=dev), torch.arange(kstart, pre, device=dev))
            keys = torch.cat([kb[old].to(q.dtype), k[t0:t0 + n]])                       # [pre - kstart + n, Hkv, D]
            vals = torch.cat([vb[old].to(q.dtype), v[t0:t0 + n]])
            k_pos = torch.arange(kstart, sl, device=dev)[None, :]
            q_pos = torch.arange(pre, sl, device=dev)[:, None]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - w)
            o = sink_softmax_attention(q[t0:t0 + n].transpose(0, 1),
                                       keys.transpose(0, 1).repeat_interleave(self.group, dim=0),
                                       vals.transpose(0, 1).repeat_interleave(self.group, dim=0), mask,
                                       self.sinks[layer_id], self.scale)
            out[t0:t0 + n] = o.transpose(0, 1)
            keep = min(n, ring.size)
            new = ring.slots(torch.tensor(row, device=dev), torch.arange(sl - keep, sl, device=dev))
            ring.store(li, new, k[t0 + n - keep:t0 + n], v[t0 + n - keep:t0 + n])
            t0 += n
        return out

    def forward_decode(self, q, k, v, layer_id, forward_batch):
        """A sliding layer's decode (module docstring): q [bs, Hq, D], k/v [bs, Hkv, D] -> [bs, Hq, D]."""
        sliding, li = self.index[layer_id]
        if not sliding:
            return self.inner.forward_decode(q, k, v, li, forward_batch)
        ring, w, bs = self.ring, self.ring.window, q.shape[0]
        fb = forward_batch
        rows, last = fb.req_pool_indices[:bs], fb.seq_lens[:bs] - 1
        loc = fb.out_cache_loc[:bs]
        ring.store(li, torch.where(loc == 0, torch.zeros_like(loc), ring.slots(rows, last)), k, v)
        pos = last[:, None] - (w - 1) + torch.arange(w, device=q.device)[None, :]            # [bs, W]
        idx = ring.slots(rows[:, None], pos).reshape(-1)
        shape = (bs, w, self.num_kv_heads, self.head_dim)
        keys = ring.k_buffer[li].index_select(0, idx).view(shape).transpose(1, 2).to(q.dtype)
        vals = ring.v_buffer[li].index_select(0, idx).view(shape).transpose(1, 2).to(q.dtype)
        keys = keys.repeat_interleave(self.group, dim=1)                                      # [bs, Hq, W, D]
        vals = vals.repeat_interleave(self.group, dim=1)
        mask = (pos >= 0)[:, None, None, :]
        o = sink_softmax_attention(q.unsqueeze(2), keys, vals, mask, self.sinks[layer_id], self.scale)
        return o.reshape(bs, self.num_heads, self.head_dim)

    # ---- the wrapped backend's decode graph hooks and attributes ----
    @property
    def supports_graph_kv_widths(self) -> bool:
        return self.inner.supports_graph_kv_widths

    @property
    def verify_as_decode(self) -> bool:
        return getattr(self.inner, "verify_as_decode", False)

    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        self.inner.init_cuda_graph_state(max_bs, max_kv_len)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode, *,
                                                 kv_width=None) -> None:
        self.inner.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens, forward_mode,
                                                            kv_width=kv_width)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu, forward_mode, *,
                                                kv_width=None) -> None:
        self.inner.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                                           forward_mode, kv_width=kv_width)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.inner.get_cuda_graph_seq_len_fill_value()
