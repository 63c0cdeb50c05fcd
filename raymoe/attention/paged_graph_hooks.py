"""Step metadata and decode-graph hooks shared by the paged SDPA backends (``torch_native``, ``mla_torch_native``).

Extend (and MIXED) steps: one :class:`SdpaRequest` per request, its slots and its causal mask shifted by its cached
prefix.

Eager decode: ``kv_indices`` [bs, L] int64 are the cache slots of each row's first L positions (L the step's
longest sequence) and ``kv_mask`` [bs, 1, 1, L] bool marks positions below each row's seq_len.

A decode graph of bucket ``bs`` at KV width ``w`` (tokens, ``raymoe.runner.graph_buckets.kv_width_ladder``) reads
fixed-address buffers sized for the largest graph (``max_bs`` rows, W = the table width): ``graph_kv_indices``
[max_bs * W] int64 and ``graph_kv_mask`` [max_bs * W] bool, flat. Its ``kv_indices`` [bs, w] (cache slots of each
row's first w positions, from the ReqToTokenPool table) and ``kv_mask`` [bs, 1, 1, w] (position < seq_len) are
contiguous views of their first ``bs * w`` elements, so the kernels captured at width w see exactly that shape and
every graph reads the same addresses. The runner refreshes the whole view in place before each replay (no stale
element of a wider or larger graph is ever read). The cost of the decode kernels (index gather, SDPA) follows w.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.step.host_transfer import to_device

_WIDTH_STEP = 16  # tokens: granularity of the attended width of a recorded graph's replay (no fixed width)


@dataclass(frozen=True)
class SdpaRequest:
    """One extend request computed by SDPA: tokens ``[start, start + ext)``, its slots [seq_len] and its causal
    mask [ext, seq_len] (None for one token)."""

    start: int
    ext: int
    slots: torch.Tensor
    mask: torch.Tensor | None


def token_starts(fb) -> list[int]:
    """Token offset of each request of an extend batch."""
    starts, start = [], 0
    for ext in fb.extend_lens_cpu:
        starts.append(start)
        start += ext
    return starts


class PagedDecodeGraphHooks:
    """Mixin of the per-step metadata (extend requests, decode ``kv_indices`` / ``kv_mask``) and the graph hooks of
    ``AttentionBackend``, for a backend holding ``req_to_token`` [rows, max_ctx] int64."""

    supports_graph_kv_widths = True  # decode cost follows the attended width: capture a width ladder
    req_to_token: torch.Tensor
    kv_indices: torch.Tensor | None
    kv_mask: torch.Tensor | None
    extend_requests: list[SdpaRequest]

    def init_forward_metadata(self, forward_batch) -> None:
        """Decode metadata for a decode step, :meth:`init_extend_metadata` for an extend or MIXED step, nothing for
        an IDLE or empty one."""
        fb = forward_batch
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            return
        if fb.forward_mode.is_decode():
            self.init_decode_metadata(fb)
            return
        if fb.forward_mode.is_target_verify() and self.verify_as_decode:
            self.init_verify_metadata(fb)
            return
        self.init_extend_metadata(fb)

    verify_as_decode = False
    """True: a TARGET_VERIFY step runs as decode rows, one per token (:meth:`init_verify_metadata`), through the
    decode path (for MLA: the weight-absorbed form, which reads the cached latent rows as they are instead of
    up-projecting every cached token's keys and values as the extend form does)."""

    def init_verify_metadata(self, fb) -> None:
        """Decode metadata with one row per token of a TARGET_VERIFY batch: the token at position ``q`` of a
        request attends to the request's positions ``[0, q]`` (its own draft chain causally)."""
        lens = to_device(fb.extend_lens_cpu, torch.int64, fb.seq_lens.device)
        rows = torch.repeat_interleave(fb.req_pool_indices, lens)
        max_len = max(fb.seq_lens_cpu)
        self.kv_indices = self.req_to_token[rows, :max_len]
        ar = torch.arange(max_len, device=fb.seq_lens.device)
        self.kv_mask = (ar[None, :] <= fb.positions[:, None])[:, None, None, :]

    def init_extend_metadata(self, fb) -> None:
        """One :class:`SdpaRequest` per request of an EXTEND/MIXED batch."""
        self.extend_requests = [self.sdpa_request(fb, i, start) for i, start in enumerate(token_starts(fb))]

    def sdpa_request(self, fb, i: int, start: int) -> SdpaRequest:
        """Request ``i`` of ``fb`` (its tokens from ``start``) as an :class:`SdpaRequest`."""
        ext, pre, sl = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]
        slots = self.req_to_token[fb.req_pool_indices_cpu[i], :sl]
        mask = None
        if ext > 1:  # query at position pre + j attends to positions [0, pre + j]
            q_pos = torch.arange(pre, sl, device=slots.device)[:, None]
            mask = torch.arange(sl, device=slots.device)[None, :] <= q_pos
        return SdpaRequest(start, ext, slots, mask)

    def init_decode_metadata(self, forward_batch) -> None:
        """Eager decode: ``kv_indices`` / ``kv_mask`` over the step's longest sequence (see the module docstring)."""
        fb = forward_batch
        max_len = max(fb.seq_lens_cpu)
        self.kv_indices = self.req_to_token[fb.req_pool_indices, :max_len]
        ar = torch.arange(max_len, device=fb.seq_lens.device)
        self.kv_mask = (ar[None, :] < fb.seq_lens[:, None])[:, None, None, :]

    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Allocate the flat buffers for ``max_bs`` rows of W = ``min(max_kv_len, max_context_len)`` tokens."""
        width = min(max_kv_len, self.req_to_token.shape[1])
        dev = self.req_to_token.device
        self.graph_max_bs, self.graph_width = max_bs, width
        self.graph_kv_indices = torch.zeros(max_bs * width, dtype=torch.int64, device=dev)
        self.graph_kv_mask = torch.zeros(max_bs * width, dtype=torch.bool, device=dev)
        self.graph_positions = torch.arange(width, device=dev)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode, *,
                                                 kv_width: int | None = None) -> None:
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, [], forward_mode,
                                                     kv_width=kv_width)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                                forward_mode, *, kv_width: int | None = None) -> None:
        """Refresh the views of rows ``[0, bs)`` at ``kv_width`` tokens (the width the graph was captured at) and
        point ``kv_indices`` / ``kv_mask`` at them. ``kv_width=None`` (a recorded graph, whose replay is a Python
        callable and may change shapes: ``raymoe.platform.reference.graphs``): the step's longest sequence rounded
        up to ``_WIDTH_STEP`` (capped at W), or W at capture. Rows must satisfy seq_len <= the width (the runner
        picks a width that holds them).

        Raises:
            ValueError: ``kv_width`` is above W or below 1, or ``bs`` above the allocated rows.
        """
        width = self.graph_width
        if kv_width is not None:
            if not 1 <= kv_width <= width:
                raise ValueError(f"graph KV width {kv_width} outside [1, {width}] tokens")
            width = kv_width
        elif len(seq_lens_cpu):
            width = min(width, -(-max(seq_lens_cpu) // _WIDTH_STEP) * _WIDTH_STEP)
        if bs > self.graph_max_bs:
            raise ValueError(f"graph batch of {bs} rows above the {self.graph_max_bs} allocated")
        indices = self.graph_kv_indices[:bs * width].view(bs, width)
        mask = self.graph_kv_mask[:bs * width].view(bs, 1, 1, width)
        indices.copy_(self.req_to_token[req_pool_indices[:bs], :width])
        mask[:, 0, 0, :].copy_(self.graph_positions[None, :width] < seq_lens[:bs, None])
        self.kv_indices, self.kv_mask = indices, mask

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """1: a padding row attends to one slot (a row with every key masked would make SDPA return NaN)."""
        return 1
