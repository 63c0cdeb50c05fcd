"""AttentionBackend: the interface between attention layers and the paged KV cache.

Lifecycle per step: the runner calls :meth:`init_forward_metadata` once with the ``ForwardBatch``; then every
attention layer calls :meth:`forward`, which stores this step's keys/values at ``forward_batch.out_cache_loc``
and attends over each request's cached tokens. Backends hold per-step metadata themselves so that two-batch
overlap can give each half its own backend (``raymoe.attention.tbo``). The rank's platform builds backends by name
(``Platform.attention_backend``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class AttentionBackend(ABC):
    """Paged attention over a ``TokenToKVPool`` addressed through a ``ReqToTokenPool``."""

    @abstractmethod
    def init_forward_metadata(self, forward_batch) -> None:
        """Precompute whatever the layers of this step share (indices, masks)."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       forward_batch) -> torch.Tensor:
        """Causal attention of extend tokens over prefix + themselves. q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       forward_batch) -> torch.Tensor:
        """One query token per request over its whole sequence. q [bs, Hq, D], k/v [bs, Hkv, D] -> [bs, Hq, D]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                forward_batch) -> torch.Tensor:
        """Dispatch on ``forward_batch.forward_mode``; an IDLE batch (zero tokens) returns an empty output."""
        mode = forward_batch.forward_mode
        if mode.is_idle() or q.shape[0] == 0:
            return q.new_empty(q.shape)
        if mode.is_decode():
            return self.forward_decode(q, k, v, layer_id, forward_batch)
        return self.forward_extend(q, k, v, layer_id, forward_batch)

    mla_absorbed_extend = False
    """MLA backends only: True when extend and MIXED steps, like decode, take the weight-absorbed queries
    ``[q_nope W_UK | q_pe]`` and return latent-space outputs (``raymoe.layers.mla``); False: extend takes full
    queries and the layer's ``expand_kv``."""

    # ---- decode graph hooks (raymoe.runner.graph_runner); backends without graph support keep these ----
    supports_graph_kv_widths = False  # True: decode cost follows the graph's KV width (CUDA captures a width ladder)

    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        """Allocate fixed-address metadata buffers for graphs of up to ``max_bs`` rows attending over at
        most ``max_kv_len`` tokens. Raises NotImplementedError when the backend cannot be captured."""
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, forward_mode, *,
                                                 kv_width: int | None = None) -> None:
        """Point this step's metadata at the graph buffers' first ``bs`` rows and fill them from the static
        inputs ``req_pool_indices``, ``seq_lens`` ([bs] int64) before capturing bucket ``bs`` at ``kv_width``
        tokens (``None``: the full width of ``init_cuda_graph_state``; a backend whose kernels do not depend on
        the width may ignore it)."""
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int],
                                                forward_mode, *, kv_width: int | None = None) -> None:
        """Refresh the graph buffers in place (same addresses) from the padded static inputs ([bs] int64;
        ``seq_lens_cpu`` their host copy) before replaying bucket ``bs`` captured at ``kv_width`` tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length given to padding rows of a graph bucket (tokens)."""
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")
