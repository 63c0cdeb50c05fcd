"""The MoE dispatcher a layer holds: normal and low-latency dispatch/combine behind one interface.

Every backend (``torch`` here, ``deepep`` in ``raymoe.platform.cuda.deepep``) exposes the same four halves, so overlap
schedules (two-batch and single-batch overlap) can run other work between an ``_a`` that starts a transfer and
the ``_b`` that waits for it:

* ``dispatch_a(hidden [N, H], topk_ids [N, k] int64, topk_weights [N, k], capacity: int | None) -> handle``:
  ``capacity`` None runs the normal mode; an int M runs the low-latency mode with M tokens per rank (the same on
  every rank of the step, chosen by the driver: ``ForwardBatch.dispatch_capacity``).
* ``dispatch_b(handle) -> ExpertRows | MaskedExpertRows | GroupedExpertRows | RoutedTokenRows``
  (``raymoe.comm.expert_input``; the torch low-latency mode answers ``GroupedExpertRows``, or ``RoutedTokenRows``
  for small CPU steps, DeepEP's ``MaskedExpertRows``).
* ``combine_a(handle, expert_out, part=0, num_parts=1)``: ``expert_out`` in the layout ``dispatch_b`` gave;
  parts (single-batch overlap) exist in the normal mode's sorted layout only.
* ``combine_b(handle) -> [N, H]``: the top-k weighted sum of the expert outputs of each token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.comm.all_to_all import DispatchHandle, TorchAllToAll
from raymoe.comm.expert_input import A2A_BACKENDS, ExpertRows, GroupedExpertRows, RoutedTokenRows
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.low_latency import LowLatencyHandle, TorchLowLatencyAllToAll, check_capacity, dense_row_experts


@dataclass
class LocalDenseHandle:
    """A dispatch that sends nothing (``ep_size == 1``) in a step small enough for the dense layout on CPU: the
    rank's tokens as one block of :class:`~raymoe.comm.expert_input.RoutedTokenRows` (their own top-k ids and
    weights), and once the combine has it, the experts' weighted sums ``combined`` [N, H]."""

    rows: RoutedTokenRows
    combined: torch.Tensor | None = None


class TorchDispatcher:
    """Normal (:class:`~raymoe.comm.all_to_all.TorchAllToAll`) and low-latency
    (:class:`~raymoe.comm.low_latency.TorchLowLatencyAllToAll`) modes over ``torch.distributed`` collectives.

    Args:
        groups: the rank's process groups (``ep_group`` is used). num_experts: routed experts E.
        dense_row_experts: the dense-layout bound (:class:`~raymoe.comm.low_latency.TorchLowLatencyAllToAll`; 0:
            never dense): low-latency steps at ``ep_size > 1``, any step at ``ep_size == 1``.
        expert_row_macs: ``3 * H * I_local`` of the layer's experts (0: unknown), which bounds the token-row layout.
    """

    def __init__(self, groups: ParallelGroups, num_experts: int, dense_row_experts: int = 0,
                 expert_row_macs: int = 0):
        self.normal = TorchAllToAll(groups, num_experts)
        self.low_latency = TorchLowLatencyAllToAll(groups, num_experts, dense_row_experts, expert_row_macs)
        self.ep_size = groups.ep_size
        self.num_local_experts = num_experts // groups.ep_size

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int | None = None) -> DispatchHandle | LowLatencyHandle | LocalDenseHandle:
        """Start the dispatch (low-latency when ``capacity`` is set). With ``ep_size == 1`` nothing is sent, and
        a small CPU step (``TorchLowLatencyAllToAll.uses_dense`` at ``M``, the capacity, else N) keeps its tokens
        whole for the token-row layout instead of sorting pairs. Raises ValueError: N > capacity."""
        rows = hidden.shape[0] if capacity is None else capacity
        if self.ep_size == 1 and self.low_latency.uses_dense(rows, topk_ids.shape[1], hidden):
            check_capacity(hidden.shape[0], rows)
            return LocalDenseHandle(RoutedTokenRows(hidden.unsqueeze(0), topk_ids.unsqueeze(0),
                                                    topk_weights.to(hidden.dtype).unsqueeze(0), 0))
        if capacity is None:
            return self.normal.dispatch_a(hidden, topk_ids, topk_weights)
        return self.low_latency.dispatch_a(hidden, topk_ids, topk_weights, capacity)

    def dispatch_b(self, handle: DispatchHandle | LowLatencyHandle | LocalDenseHandle
                   ) -> ExpertRows | GroupedExpertRows | RoutedTokenRows:
        """Wait for the dispatch; returns the received pairs in the mode's layout."""
        if isinstance(handle, LowLatencyHandle):
            return self.low_latency.dispatch_b(handle)
        if isinstance(handle, LocalDenseHandle):
            return handle.rows
        return self.normal.dispatch_b(handle)

    def combine_a(self, handle: DispatchHandle | LowLatencyHandle | LocalDenseHandle, expert_out: torch.Tensor,
                  part: int = 0, num_parts: int = 1) -> None:
        """Start the combine of ``expert_out`` (layout of ``dispatch_b``'s answer).

        Raises:
            ValueError: a low-latency or dense combine sent in parts.
        """
        if num_parts != 1 and isinstance(handle, LowLatencyHandle | LocalDenseHandle):
            raise ValueError("a low-latency or dense combine is sent in one part")
        if isinstance(handle, LocalDenseHandle):
            handle.combined = expert_out  # already the weighted sums
        elif isinstance(handle, LowLatencyHandle):
            self.low_latency.combine_a(handle, expert_out)
        else:
            self.normal.combine_a(handle, expert_out, part=part, num_parts=num_parts)

    def combine_b(self, handle: DispatchHandle | LowLatencyHandle | LocalDenseHandle) -> torch.Tensor:
        """Wait for the combine; returns the weighted per-token sums [N, H]."""
        if isinstance(handle, LowLatencyHandle):
            return self.low_latency.combine_b(handle)
        if isinstance(handle, LocalDenseHandle):
            assert handle.combined is not None, "combine_a must run before combine_b"
            return handle.combined
        return self.normal.combine_b(handle)


@dataclass(frozen=True)
class A2ABackendSpec:
    """Which all-to-all backend a MoE layer builds, with the engine-wide options a DeepEP buffer is sized by
    (``RunnerConfig.a2a_backend`` / ``a2a_mode`` / ``num_max_dispatch_tokens_per_rank``; same on every rank)."""

    name: str = "torch"
    mode: str = "auto"
    num_max_dispatch_tokens_per_rank: int = 256

    def options(self, hidden_size: int, dtype: torch.dtype, intermediate_size: int = 0) -> dict:
        """Constructor options of the backend for a layer of ``hidden_size``, ``dtype`` and local expert
        ``intermediate_size`` (torch: the dense-layout bound, :func:`~raymoe.comm.low_latency.dense_row_experts`,
        none without an intermediate size, and the experts' MACs per row)."""
        if self.name != "deepep":
            return {"dense_row_experts": dense_row_experts(hidden_size, intermediate_size) if intermediate_size else 0,
                    "expert_row_macs": 3 * hidden_size * intermediate_size}
        return {"hidden_size": hidden_size, "dtype": dtype, "low_latency": self.mode != "normal",
                "num_max_dispatch_tokens_per_rank": self.num_max_dispatch_tokens_per_rank}


def get_all_to_all_backend(name: str, groups: ParallelGroups, num_experts: int, **options):
    """Build the dispatcher of backend ``name``: ``"torch"`` (CPU and GPU) or ``"deepep"`` (CUDA + ``deep_ep``,
    imported lazily; ``options`` go to :class:`~raymoe.platform.cuda.deepep.DeepEPDispatcher`: ``hidden_size``, ``dtype``,
    ``num_max_dispatch_tokens_per_rank``, ``low_latency``, ``buffer_factory``; see :meth:`A2ABackendSpec.options`).

    Raises:
        ValueError: unknown backend name.
        ImportError: ``deepep`` without the ``deep_ep`` package (the message names it).
    """
    if name not in A2A_BACKENDS:
        raise ValueError(f"unknown all-to-all backend {name!r} (expected one of {A2A_BACKENDS})")
    if name == "torch":
        return TorchDispatcher(groups, num_experts, **options)
    from raymoe.platform.cuda.deepep import DeepEPDispatcher  # lazy: needs CUDA and deep_ep

    return DeepEPDispatcher(groups, num_experts, **options)
