"""TboAttnBackend: one attention backend per two-batch-overlap child, behind the ordinary backend interface.

Two-batch overlap (DESIGN section 4) interleaves the layers of two half-batches, so each half needs its own
per-step attention metadata (KV indices, masks) that stays valid while the other half runs. This composite holds
a ``primary`` backend for whole batches and two ``children`` of the same type for the halves; the runner hands
the children to ``TboForwardBatchPreparer`` so each child ``ForwardBatch`` points at its own backend. The model
never sees the composite during a TBO step (child batches carry the child backends); for whole batches it
forwards to ``primary``. Decode-graph hooks go to ``primary`` (graphs never run TBO steps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raymoe.attention.base import AttentionBackend


class TboAttnBackend(AttentionBackend):
    """Composite of a primary backend and two child backends with independent metadata.

    Args:
        primary: backend for whole (non-TBO) batches.
        children: exactly two backends for child A and child B.
    Raises:
        ValueError: not exactly two children.
    """

    def __init__(self, primary: AttentionBackend, children: list[AttentionBackend]):
        if len(children) != 2:
            raise ValueError(f"TboAttnBackend needs two child backends, got {len(children)}")
        self.primary = primary
        self.children = list(children)

    @property
    def mla_absorbed_extend(self) -> bool:
        """The children's (and primary's) form of MLA extend steps (``AttentionBackend.mla_absorbed_extend``)."""
        return self.primary.mla_absorbed_extend

    @classmethod
    def create(cls, factory: Callable[[], AttentionBackend]) -> TboAttnBackend:
        """Three independent backends from ``factory`` (they share the KV pools, not their metadata)."""
        return cls(factory(), [factory(), factory()])

    def init_forward_metadata(self, forward_batch) -> None:
        """Metadata of the whole batch, or of each child when ``forward_batch.tbo_children`` is set.

        Raises:
            ValueError: a child batch does not point at its own child backend.
        """
        children = forward_batch.tbo_children
        if children is None:
            self.primary.init_forward_metadata(forward_batch)
            return
        for backend, child in zip(self.children, children, strict=True):
            if child.attn_backend is not backend:
                raise ValueError("a TBO child ForwardBatch must use its own child attention backend")
            backend.init_forward_metadata(child)

    @property
    def verify_as_decode(self) -> bool:
        """The primary's form of TARGET_VERIFY steps (``PagedDecodeGraphHooks.verify_as_decode``)."""
        return getattr(self.primary, "verify_as_decode", False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                forward_batch) -> torch.Tensor:
        """The primary's dispatch (a step without children runs on the primary's metadata)."""
        return self.primary.forward(q, k, v, layer_id, forward_batch)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       forward_batch) -> torch.Tensor:
        return self.primary.forward_extend(q, k, v, layer_id, forward_batch)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       forward_batch) -> torch.Tensor:
        return self.primary.forward_decode(q, k, v, layer_id, forward_batch)

    # ---- decode graph hooks: graphs replay whole batches only ----
    def init_cuda_graph_state(self, max_bs: int, max_kv_len: int) -> None:
        self.primary.init_cuda_graph_state(max_bs, max_kv_len)

    @property
    def supports_graph_kv_widths(self) -> bool:
        return self.primary.supports_graph_kv_widths

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_mode, *,
                                                 kv_width=None) -> None:
        self.primary.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens, forward_mode,
                                                              kv_width=kv_width)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                                forward_mode, *, kv_width=None) -> None:
        self.primary.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                                             forward_mode, kv_width=kv_width)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.primary.get_cuda_graph_seq_len_fill_value()
