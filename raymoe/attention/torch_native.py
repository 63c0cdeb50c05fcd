"""Paged attention in plain PyTorch (``scaled_dot_product_attention``); runs on CPU and GPU.

Decode gathers each request's keys/values through its ReqToTokenPool row into a padded [bs, L_max] batch and
masks the padding; grouped-query heads are folded into the query-length dim so KV is never repeated.
Extend runs one SDPA call per request with a causal mask shifted by the cached prefix length; on a float32 CPU cache,
requests short enough (``EXTEND_KERNEL_MAX_PAIRS``) take the fused paged-attention kernel instead, one query token
per row reading its request's slot row of the ``ReqToTokenPool`` table in place
(``raymoe.platform.cpu.kernels.cpu_ops.extend_attention``).
Under a decode graph (``raymoe.runner.graph_runner``) the same decode kernel reads fixed-address index/mask
buffers, refreshed in place by the graph hooks before each replay, over the graph's KV width (on CUDA one capture
per width of a ladder up to the table width; ``raymoe.attention.paged_graph_hooks``).

On CPU the decode gather writes into two buffers the backend keeps (grown on demand, shared by every layer): a
fresh multi-megabyte tensor per layer would come from ``mmap`` and be page-faulted in on every call, which made
the gather at 256 requests cost ten times the copy itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raymoe.attention.base import AttentionBackend
from raymoe.attention.paged_graph_hooks import PagedDecodeGraphHooks
from raymoe.kvcache.pools import ReqToTokenPool, TokenToKVPool
from raymoe.platform.cpu.kernels import cpu_ops
from raymoe.platform.cpu.kernels.attn_block import BlockAttentionInputs

# Most (query, key) pairs one extend request may attend to for the fused kernel; longer requests take SDPA. The
# kernel loops over pairs (about 50 ns each for 4 query heads of 32 on this project's CPU); SDPA costs about 0.1 ms
# per request and layer before its GEMMs, which then win: measured even at about 8,000 pairs (one 128-token
# prompt), SDPA ahead from about 30,000 (docs/performance.md).
EXTEND_KERNEL_MAX_PAIRS = 8192


@dataclass(frozen=True)
class _KernelRun:
    """Consecutive extend requests computed by one kernel call: tokens ``[start, end)``, each token's table row
    and attended length ([end - start] int64), and the longest sequence of the run (the table columns read)."""

    start: int
    end: int
    token_rows: torch.Tensor
    token_lens: torch.Tensor
    width: int


@dataclass(frozen=True)
class _SdpaRequest:
    """One extend request computed by SDPA: tokens ``[start, start + ext)``, its slots [seq_len] and its causal
    mask [ext, seq_len] (None for one token)."""

    start: int
    ext: int
    slots: torch.Tensor
    mask: torch.Tensor | None


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
        self.kv_indices: torch.Tensor | None = None
        self.kv_mask: torch.Tensor | None = None
        # extend: per run of requests, a kernel segment or one SDPA request (see _extend_segments)
        self.extend_segments: list[_KernelRun | _SdpaRequest] = []
        self._gather_k: torch.Tensor | None = None  # CPU decode gather buffers [rows, Hkv, D], see module doc
        self._gather_v: torch.Tensor | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            return
        if fb.forward_mode.is_decode():
            self.init_decode_metadata(fb)
            return
        self.extend_segments = self._extend_segments(fb, cpu_ops.enabled_for(self.kv_pool.k_buffer[0]))

    def _extend_segments(self, fb, kernel: bool) -> list[_KernelRun | _SdpaRequest]:
        """Split an EXTEND/MIXED batch into runs of consecutive requests for the fused kernel (when ``kernel``
        and the request attends to at most ``EXTEND_KERNEL_MAX_PAIRS`` (query, key) pairs) and single requests
        for SDPA (longer ones, where SDPA's GEMMs beat the kernel's per-pair loop)."""
        segments: list[_KernelRun | _SdpaRequest] = []
        rows: list[int] = []
        lens: list[int] = []
        run_start = start = 0
        width = 0

        def close_run() -> None:
            if rows:
                segments.append(_KernelRun(run_start, start, torch.tensor(rows, dtype=torch.int64),
                                           torch.tensor(lens, dtype=torch.int64), width))
                rows.clear()
                lens.clear()

        for i in range(fb.batch_size):
            ext, pre, sl = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            row = fb.req_pool_indices_cpu[i]
            if kernel and ext * pre + ext * (ext + 1) // 2 <= EXTEND_KERNEL_MAX_PAIRS:
                if not rows:
                    run_start, width = start, 0
                rows += [row] * ext  # token t at position pre + j attends to slots [0, pre + j + 1): causal
                lens += range(pre + 1, sl + 1)
                width = max(width, sl)
            else:
                close_run()
                slots = self.req_to_token[row, :sl]
                mask = None
                if ext > 1:
                    q_pos = torch.arange(pre, sl, device=slots.device)[:, None]
                    mask = torch.arange(sl, device=slots.device)[None, :] <= q_pos
                segments.append(_SdpaRequest(start, ext, slots, mask))
            start += ext
        close_run()
        return segments

    def forward_extend(self, q, k, v, layer_id, forward_batch):
        """Extend attention: ``q`` [T, Hq, D], ``k``/``v`` [T, Hkv, D] (written to ``out_cache_loc`` first) ->
        [T, Hq, D], per segment of ``init_forward_metadata``: a run of short requests through the fused kernel
        (``cpu_ops.extend_attention``, reading each request's table row in place), a longer request through SDPA
        over its gathered keys/values with a causal mask shifted by its cached prefix."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        kernel = cpu_ops.enabled_for(q, k, v, k_buf)
        if not kernel and any(isinstance(s, _KernelRun) for s in self.extend_segments):
            self.extend_segments = self._extend_segments(forward_batch, False)  # q cannot take the kernel
        if kernel:
            cpu_ops.kv_store(k, v, forward_batch.out_cache_loc, k_buf, v_buf)
        else:
            self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        scale = self.head_dim ** -0.5
        segs = self.extend_segments
        if len(segs) == 1 and isinstance(segs[0], _KernelRun):  # the common case: no copy
            s = segs[0]
            return cpu_ops.extend_attention(q, k_buf, v_buf, self.req_to_token[:, :s.width], s.token_rows,
                                            s.token_lens, scale)
        out = torch.empty_like(q)
        for s in segs:
            if isinstance(s, _KernelRun):
                out[s.start:s.end] = cpu_ops.extend_attention(q[s.start:s.end], k_buf, v_buf,
                                                              self.req_to_token[:, :s.width], s.token_rows,
                                                              s.token_lens, scale)
                continue
            qi = q[s.start:s.start + s.ext].transpose(0, 1).unsqueeze(0)        # [1, Hq, ext, D]
            ki = k_buf[s.slots].transpose(0, 1).unsqueeze(0).to(q.dtype)        # [1, Hkv, L, D]
            vi = v_buf[s.slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=s.mask, enable_gqa=self.group > 1)
            out[s.start:s.start + s.ext] = o[0].transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer_id, forward_batch):
        """Decode attention: ``q`` [bs, Hq, D], ``k``/``v`` [bs, Hkv, D] (written to ``out_cache_loc`` first)
        -> [bs, Hq, D]; keys/values of each row are gathered over ``kv_indices`` [bs, L] and masked by ``kv_mask``.
        A float32 CPU cache takes the fused kernels instead (``raymoe.platform.cpu.kernels.cpu_ops.kv_store`` and
        ``decode_attention``): they read the cache through ``kv_indices`` in place, masked by ``seq_lens``, with
        no gather and no SDPA call."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        if cpu_ops.enabled_for(q, k, v, k_buf):
            cpu_ops.kv_store(k, v, forward_batch.out_cache_loc, k_buf, v_buf)
            return cpu_ops.decode_attention(q, k_buf, v_buf, self.kv_indices, forward_batch.seq_lens,
                                            self.head_dim ** -0.5)
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        bs = q.shape[0]
        idx = self.kv_indices.reshape(-1)  # index_select is far faster than advanced indexing on CPU
        shape = (*self.kv_indices.shape, self.num_kv_heads, self.head_dim)
        keys, values = self._gather(k_buf, v_buf, idx)
        keys = keys.view(shape).transpose(1, 2).to(q.dtype)      # [bs, Hkv, L, D]
        values = values.view(shape).transpose(1, 2).to(q.dtype)
        qg = q.view(bs, self.num_kv_heads, self.group, self.head_dim)     # [bs, Hkv, G, D]
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=self.kv_mask)
        return o.reshape(bs, self.num_heads, self.head_dim)

    def block_attention_inputs(self, layer_id, forward_batch):
        """The cache and this step's slot lists where :meth:`forward_decode` would take the fused kernels, or
        :meth:`forward_extend` one kernel run over every token (short requests, the common MIXED step)."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        if not cpu_ops.enabled_for(k_buf):
            return None
        if forward_batch.forward_mode.is_decode():
            return BlockAttentionInputs(k_buf, v_buf, self.kv_indices, None, forward_batch.seq_lens)
        segs = self.extend_segments
        if len(segs) != 1 or not isinstance(segs[0], _KernelRun) or segs[0].end != forward_batch.num_tokens:
            return None
        s = segs[0]
        return BlockAttentionInputs(k_buf, v_buf, self.req_to_token[:, :s.width], s.token_rows, s.token_lens)

    def _gather(self, k_buf: torch.Tensor, v_buf: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``idx`` [N] of ``k_buf``/``v_buf`` [slots, Hkv, D] -> two [N, Hkv, D] tensors. On CPU they are
        views of the backend's gather buffers (valid until the next call); elsewhere fresh tensors (a CUDA graph
        must own what it reads, and the caching allocator makes them cheap)."""
        if k_buf.device.type != "cpu":
            return k_buf.index_select(0, idx), v_buf.index_select(0, idx)
        n = idx.shape[0]
        if self._gather_k is None or self._gather_k.shape[0] < n or self._gather_k.dtype != k_buf.dtype:
            self._gather_k = k_buf.new_empty((n, *k_buf.shape[1:]))
            self._gather_v = v_buf.new_empty((n, *v_buf.shape[1:]))
        keys = torch.index_select(k_buf, 0, idx, out=self._gather_k[:n])
        values = torch.index_select(v_buf, 0, idx, out=self._gather_v[:n])
        return keys, values
