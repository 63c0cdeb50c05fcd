"""Paged attention with attention sinks and per-layer sliding windows (gpt-oss), in plain PyTorch; any device.

* **Sinks** (gpt-oss; Xiao et al. 2023, arXiv:2309.17453, as a learned logit): each query head ``h`` has a logit
  ``sink[h]`` that joins the softmax over the keys and is then dropped, so the weights of the real keys sum to less
  than one: ``p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))``. transformers' ``eager_attention_forward`` of
  ``GptOssAttention`` is the reference (the logits shifted by their maximum, sink included, before the softmax).
* **Sliding windows** (``ModelConfig.attention_window``): a query at position ``p`` of a windowed layer attends to
  key positions ``k`` with ``p - window < k <= p`` (transformers' ``sliding_window_overlay``). The cache still
  holds every position (no eviction: the request's slots stay allocated until it ends); the window only masks.

Step metadata, the decode graph hooks and the decode gather are :class:`~raymoe.attention.torch_native.
TorchNativeAttnBackend`'s; the window masks are derived from them per step (extend: once per distinct window and
request) or per layer from ``forward_batch.seq_lens`` (decode; fixed shapes, so decode graphs capture it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raymoe.attention.torch_native import TorchNativeAttnBackend


def sink_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``softmax([q k^T * scale, sink]) v`` without the sink's column.

    Args:
        q: [..., H, M, D] queries. k, v: [..., H, L, D] keys and values (heads already matched to the queries).
        mask: bool, broadcastable to [..., H, M, L]; True where a key may be attended. Every row needs a True
            entry unless ``sinks`` is given (a row of only masked keys then answers zeros).
        sinks: [H] logits, or None for plain softmax attention.
        scale: multiplies the dot products.
    Returns:
        [..., H, M, D] in ``q``'s dtype.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


class SinkWindowAttnBackend(TorchNativeAttnBackend):
    """``torch_native`` with per-layer sinks and windows (module docstring).

    Args:
        req_to_token_pool, token_to_kv_pool, num_heads, num_kv_heads, head_dim: as
            :class:`~raymoe.attention.torch_native.TorchNativeAttnBackend` (this rank's heads).
        windows: per layer, the attention window in tokens or None (every position).
        sinks: per layer, the [num_heads] sink logits of this rank's query heads (the model's own tensors, read at
            each forward, so weights loaded later are seen) or None.
        scale: softmax scale; None: ``head_dim ** -0.5``.

    Raises:
        ValueError: ``windows`` and ``sinks`` differ in length, a window below 1, or a sink tensor of the wrong size.
    """

    def __init__(self, req_to_token_pool, token_to_kv_pool, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 windows: Sequence[int | None], sinks: Sequence[torch.Tensor | None], scale: float | None = None):
        super().__init__(req_to_token_pool, token_to_kv_pool, num_heads, num_kv_heads, head_dim)
        if len(windows) != len(sinks):
            raise ValueError(f"{len(windows)} windows for {len(sinks)} layers of sinks")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"attention windows must be >= 1 tokens, got {list(windows)}")
        if any(s is not None and tuple(s.shape) != (num_heads,) for s in sinks):
            raise ValueError(f"sink logits must have shape ({num_heads},)")
        self.windows = tuple(windows)
        self.sinks = tuple(sinks)
        if scale is not None:
            self.scale = scale
        self.extend_masks: dict[int | None, list[torch.Tensor]] = {}

    def init_extend_metadata(self, fb) -> None:
        """The base's per-request slots, then each request's [ext, seq_len] mask for every window of the model
        (causal, and for a window ``w`` also ``key > query - w``)."""
        super().init_extend_metadata(fb)
        masks: dict[int | None, list[torch.Tensor]] = {w: [] for w in set(self.windows)}
        for i, s in enumerate(self.extend_requests):
            pre, sl = fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            dev = s.slots.device
            q_pos = torch.arange(pre, sl, device=dev)[:, None]
            k_pos = torch.arange(sl, device=dev)[None, :]
            causal = k_pos <= q_pos
            for w, lst in masks.items():
                lst.append(causal if w is None else causal & (k_pos > q_pos - w))
        self.extend_masks = masks

    def forward_extend(self, q, k, v, layer_id, forward_batch):
        """Extend attention: ``q`` [T, Hq, D], ``k``/``v`` [T, Hkv, D] (written to ``out_cache_loc`` first) ->
        [T, Hq, D], per request over its gathered keys/values under the layer's window mask, with its sinks."""
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        masks = self.extend_masks[self.windows[layer_id]]
        sinks = self.sinks[layer_id]
        out = torch.empty_like(q)
        for s, mask in zip(self.extend_requests, masks, strict=True):
            qi = q[s.start:s.start + s.ext].transpose(0, 1)                                    # [Hq, ext, D]
            ki = k_buf[s.slots].transpose(0, 1).to(q.dtype).repeat_interleave(self.group, dim=0)   # [Hq, L, D]
            vi = v_buf[s.slots].transpose(0, 1).to(q.dtype).repeat_interleave(self.group, dim=0)
            o = sink_softmax_attention(qi, ki, vi, mask, sinks, self.scale)
            out[s.start:s.start + s.ext] = o.transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer_id, forward_batch):
        """Decode attention: ``q`` [bs, Hq, D], ``k``/``v`` [bs, Hkv, D] (written first) -> [bs, Hq, D] over
        ``kv_indices`` [bs, L] under ``kv_mask`` and, for a windowed layer, positions ``>= seq_len - window``."""
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        bs, width = self.kv_indices.shape
        keys, values = self.gather(k_buf, v_buf, self.kv_indices.reshape(-1))
        shape = (bs, width, self.num_kv_heads, self.head_dim)
        keys = keys.view(shape).transpose(1, 2).to(q.dtype).repeat_interleave(self.group, dim=1)    # [bs, Hq, L, D]
        values = values.view(shape).transpose(1, 2).to(q.dtype).repeat_interleave(self.group, dim=1)
        mask = self.kv_mask                                                                    # [bs, 1, 1, L]
        window = self.windows[layer_id]
        if window is not None:
            pos = torch.arange(width, device=mask.device)
            mask = mask & (pos[None, :] >= forward_batch.seq_lens[:bs, None] - window)[:, None, None, :]
        o = sink_softmax_attention(q.unsqueeze(2), keys, values, mask, self.sinks[layer_id], self.scale)
        return o.reshape(bs, self.num_heads, self.head_dim)
