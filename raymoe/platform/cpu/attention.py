"""The CPU platform's ``torch_native`` attention: the reference SDPA backend with the fused paged-attention kernels
(``raymoe.platform.cpu.kernels.cpu_ops``) over a float32 cache.

* Decode: the KV store and paged decode attention read the cache through ``kv_indices`` in place, masked by
  ``seq_lens``: no gather and no SDPA call.
* Extend (and MIXED): requests short enough (:data:`EXTEND_KERNEL_MAX_PAIRS`) run the same paged kernel with one
  query token per row, each token naming its request's ``ReqToTokenPool`` row and its causal length, in runs of
  consecutive requests; longer requests keep SDPA, whose GEMMs win there.
* The fused attention block (``raymoe.platform.cpu.fusion``) reads the cache and the step's slot lists from
  :meth:`CpuPagedAttnBackend.block_attention_inputs`.
* Without the kernels (another dtype, ``RAYMOE_CPU_KERNELS=0``), the reference paths run, and the decode gather
  writes into two buffers the backend keeps (grown on demand, shared by every layer): a fresh multi-megabyte tensor
  per layer would come from ``mmap`` and be page-faulted in on every call, which made the gather at 256 requests
  cost ten times the copy itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.attention.paged_graph_hooks import SdpaRequest, token_starts
from raymoe.attention.torch_native import TorchNativeAttnBackend
from raymoe.platform.cpu.kernels import cpu_ops
from raymoe.platform.cpu.kernels.attn_block import BlockAttentionInputs

EXTEND_KERNEL_MAX_PAIRS = 8192
"""Most (query, key) pairs one extend request may attend to for the fused kernel; longer requests take SDPA. The
kernel loops over pairs (about 50 ns each for 4 query heads of 32 on the CI machine); SDPA costs about 0.1 ms per
request and layer before its GEMMs, which then win: measured even at about 8,000 pairs (one 128-token prompt),
SDPA ahead from about 30,000."""


@dataclass(frozen=True)
class KernelRun:
    """Consecutive extend requests computed by one kernel call: tokens ``[start, end)``, each token's table row
    and attended length ([end - start] int64), and the longest sequence of the run (the table columns read)."""

    start: int
    end: int
    token_rows: torch.Tensor
    token_lens: torch.Tensor
    width: int


class CpuPagedAttnBackend(TorchNativeAttnBackend):
    """``torch_native`` with the fused CPU kernels (module docstring); same arguments as its base."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extend_segments: list[KernelRun | SdpaRequest] = []
        self._gather_k: torch.Tensor | None = None  # decode gather buffers [rows, Hkv, D] (module docstring)
        self._gather_v: torch.Tensor | None = None

    def init_extend_metadata(self, fb) -> None:
        """Split an EXTEND/MIXED batch into runs of short requests for the kernel and single longer requests for
        SDPA (all SDPA where the cache is not one the kernel takes)."""
        kernel = cpu_ops.enabled_for(self.kv_pool.k_buffer[0])
        segments: list[KernelRun | SdpaRequest] = []
        rows: list[int] = []
        lens: list[int] = []
        run_start = start = width = 0

        def close_run() -> None:
            if rows:
                segments.append(KernelRun(run_start, start, torch.tensor(rows, dtype=torch.int64),
                                          torch.tensor(lens, dtype=torch.int64), width))
                rows.clear()
                lens.clear()

        for i in range(fb.batch_size):
            ext, pre, sl = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]
            if kernel and ext * pre + ext * (ext + 1) // 2 <= EXTEND_KERNEL_MAX_PAIRS:
                if not rows:
                    run_start, width = start, 0
                rows += [fb.req_pool_indices_cpu[i]] * ext  # token at position pre + j attends to [0, pre + j]
                lens += range(pre + 1, sl + 1)
                width = max(width, sl)
            else:
                close_run()
                segments.append(self.sdpa_request(fb, i, start))
            start += ext
        close_run()
        self.extend_segments = segments
        self.extend_requests = [s for s in segments if isinstance(s, SdpaRequest)]

    def forward_extend(self, q, k, v, layer_id, forward_batch):
        """Extend attention per segment of :meth:`init_extend_metadata`: a run of short requests through the
        kernel (reading each request's table row in place), a longer request through SDPA."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        segs = self.extend_segments
        if not cpu_ops.enabled_for(q, k, v, k_buf):
            if any(isinstance(s, KernelRun) for s in segs):  # q cannot take the kernel: all SDPA
                self.extend_requests = [self.sdpa_request(forward_batch, i, s)
                                        for i, s in enumerate(token_starts(forward_batch))]
            return super().forward_extend(q, k, v, layer_id, forward_batch)
        cpu_ops.kv_store(k, v, forward_batch.out_cache_loc, k_buf, v_buf)
        if len(segs) == 1 and isinstance(segs[0], KernelRun):  # the common case: no copy
            s = segs[0]
            return cpu_ops.extend_attention(q, k_buf, v_buf, self.req_to_token[:, :s.width], s.token_rows,
                                            s.token_lens, self.scale)
        out = torch.empty_like(q)
        for s in segs:
            if isinstance(s, KernelRun):
                out[s.start:s.end] = cpu_ops.extend_attention(q[s.start:s.end], k_buf, v_buf,
                                                              self.req_to_token[:, :s.width], s.token_rows,
                                                              s.token_lens, self.scale)
            else:
                out[s.start:s.start + s.ext] = self.sdpa_extend(q, k_buf, v_buf, s)
        return out

    def forward_decode(self, q, k, v, layer_id, forward_batch):
        """The fused KV store and paged decode attention over a float32 cache; the reference path otherwise."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        if not cpu_ops.enabled_for(q, k, v, k_buf):
            return super().forward_decode(q, k, v, layer_id, forward_batch)
        cpu_ops.kv_store(k, v, forward_batch.out_cache_loc, k_buf, v_buf)
        return cpu_ops.decode_attention(q, k_buf, v_buf, self.kv_indices, forward_batch.seq_lens, self.scale)

    def block_attention_inputs(self, layer_id: int, forward_batch) -> BlockAttentionInputs | None:
        """The cache and this step's slot lists where :meth:`forward_decode` would take the kernels, or
        :meth:`forward_extend` one kernel run over every token (short requests, the common MIXED step); None
        otherwise (the layer then runs its attention ops one by one)."""
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer_id)
        if not cpu_ops.enabled_for(k_buf):
            return None
        if forward_batch.forward_mode.is_decode():
            return BlockAttentionInputs(k_buf, v_buf, self.kv_indices, None, forward_batch.seq_lens)
        segs = self.extend_segments
        if len(segs) != 1 or not isinstance(segs[0], KernelRun) or segs[0].end != forward_batch.num_tokens:
            return None
        s = segs[0]
        return BlockAttentionInputs(k_buf, v_buf, self.req_to_token[:, :s.width], s.token_rows, s.token_lens)

    def gather(self, k_buf: torch.Tensor, v_buf: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``idx`` [N] of ``k_buf``/``v_buf`` as views of the backend's gather buffers (valid until the next
        call; module docstring)."""
        if k_buf.device.type != "cpu":
            return super().gather(k_buf, v_buf, idx)
        n = idx.shape[0]
        if self._gather_k is None or self._gather_k.shape[0] < n or self._gather_k.dtype != k_buf.dtype:
            self._gather_k = k_buf.new_empty((n, *k_buf.shape[1:]))
            self._gather_v = v_buf.new_empty((n, *v_buf.shape[1:]))
        keys = torch.index_select(k_buf, 0, idx, out=self._gather_k[:n])
        values = torch.index_select(v_buf, 0, idx, out=self._gather_v[:n])
        return keys, values

