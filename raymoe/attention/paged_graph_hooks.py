"""Decode metadata and decode-graph hooks shared by the paged SDPA backends (``torch_native``, ``mla_torch_native``).

Eager decode: ``kv_indices`` [bs, L] int64 are the cache slots of each row's first L positions (L the step's
longest sequence) and ``kv_mask`` [bs, 1, 1, L] bool marks positions below each row's seq_len.

A captured decode graph reads fixed-address buffers: ``graph_kv_indices`` [max_bs, W] int64 (cache slots of each
row's positions, from the ReqToTokenPool table) and ``graph_kv_mask`` [max_bs, 1, 1, W] bool (position <
seq_len). The runner refreshes them in place before each replay; the backend's decode kernel reads
``kv_indices`` / ``kv_mask``, views of their first ``bs`` rows.
"""

from __future__ import annotations

import torch

_CPU_WIDTH_STEP = 16  # tokens: granularity of the attended width of a CPU graph replay


class PagedDecodeGraphHooks:
    """Mixin of the eager decode metadata and the graph hooks of ``AttentionBackend``, for a backend holding
    ``req_to_token`` [rows, max_ctx] int64 and reading ``kv_indices`` / ``kv_mask`` in its decode kernel."""

    req_to_token: torch.Tensor
    kv_indices: torch.Tensor | None
    kv_mask: torch.Tensor | None

    def init_decode_metadata(self, forward_batch) -> None:
        """Eager decode: ``kv_indices`` / ``kv_mask`` over the step's longest sequence (see the module docstring)."""
        fb = forward_batch
        max_len = max(fb.seq_lens_cpu)
        self.kv_indices = self.req_to_token[fb.req_pool_indices, :max_len]
        ar = torch.arange(max_len, device=fb.seq_lens.device)
        self.kv_mask = (ar[None, :] < fb.seq_lens[:, None])[:, None, None, :]

    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Allocate the buffers with W = ``min(max_kv_len, max_context_len)``: a graph always attends over W slots
        (masked past seq_len), since its shapes cannot follow the step's longest sequence."""
        width = min(max_kv_len, self.req_to_token.shape[1])
        dev = self.req_to_token.device
        self.graph_kv_indices = torch.zeros((max_bs, width), dtype=torch.int64, device=dev)
        self.graph_kv_mask = torch.zeros((max_bs, 1, 1, width), dtype=torch.bool, device=dev)
        self.graph_positions = torch.arange(width, device=dev)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode) -> None:
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, [], forward_mode)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                                forward_mode) -> None:
        """Refresh the buffers for rows ``[0, bs)``. On CUDA the captured kernels read all W columns; on CPU a
        replay is a Python callable whose shapes may change, so it attends only over the step's longest sequence
        rounded up to ``_CPU_WIDTH_STEP`` columns (same buffers, a narrower view)."""
        width = self.graph_kv_indices.shape[1]
        if self.graph_kv_indices.device.type == "cpu" and len(seq_lens_cpu):
            width = min(width, -(-max(seq_lens_cpu) // _CPU_WIDTH_STEP) * _CPU_WIDTH_STEP)
        self.graph_kv_indices[:bs, :width].copy_(self.req_to_token[req_pool_indices[:bs], :width])
        self.graph_kv_mask[:bs, 0, 0, :width].copy_(self.graph_positions[None, :width] < seq_lens[:bs, None])
        self.kv_indices = self.graph_kv_indices[:bs, :width]
        self.kv_mask = self.graph_kv_mask[:bs, :, :, :width]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1: a padding row attends to one slot (a row with every key masked would make SDPA return NaN)."""
        return 1
