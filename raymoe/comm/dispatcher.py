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
from typing import Any, Protocol

import torch

from raymoe.comm.all_to_all import DispatchHandle, TorchAllToAll
from raymoe.comm.expert_input import ExpertRows, GroupedExpertRows, RoutedTokenRows
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.low_latency import LowLatencyHandle, LowLatencyOps, TorchLowLatencyAllToAll, check_capacity


@dataclass
class LocalDenseHandle:
    """A dispatch that sends nothing (``ep_size == 1``) in a step small enough for the dense layout on CPU: the
    rank's tokens as one block of :class:`~raymoe.comm.expert_input.RoutedTokenRows` (their own top-k ids and
    weights), and once the combine has it, the experts' weighted sums ``combined`` [N, H]."""

    rows: RoutedTokenRows
    combined: torch.Tensor | None = None


class MoeDispatcher(Protocol):
    """The four halves every MoE all-to-all backend exposes (module docstring)."""

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int | None = None) -> Any: ...

    def dispatch_b(self, handle: Any) -> Any: ...

    def combine_a(self, handle: Any, expert_out: torch.Tensor, part: int = 0, num_parts: int = 1) -> None: ...

    def combine_b(self, handle: Any) -> torch.Tensor: ...

    def receives_through_hooks(self, capacity: int | None) -> bool:
        """Whether a step with this dispatch ``capacity`` (None: normal mode) receives through hooks that must run
        on one stream in launch order (DeepEP's low-latency kernels); such a step keeps both two-batch-overlap
        children on one stream (``raymoe.overlap.streams``)."""
        ...


class TorchDispatcher:
    """Normal (:class:`~raymoe.comm.all_to_all.TorchAllToAll`) and low-latency
    (:class:`~raymoe.comm.low_latency.TorchLowLatencyAllToAll`) modes over the EP group's transport.

    Args:
        groups: the rank's process groups (``ep_transport`` / ``ep_group`` are used). num_experts: routed experts E.
        ops: the rank's platform: it picks the expert layout of low-latency steps (at ``ep_size == 1``, of any
            step: :meth:`~raymoe.platform.interface.Platform.use_token_rows`) and writes the messages.
        expert_row_macs: ``3 * H * I_local`` of the layer's experts (0: unknown).
    """

    def __init__(self, groups: ParallelGroups, num_experts: int, ops: LowLatencyOps, expert_row_macs: int = 0):
        self.normal = TorchAllToAll(groups, num_experts)
        self.low_latency = TorchLowLatencyAllToAll(groups, num_experts, ops, expert_row_macs)
        self.ep_size = groups.ep_size
        self.num_local_experts = num_experts // groups.ep_size

    def receives_through_hooks(self, capacity: int | None) -> bool:
        """False: ``torch.distributed`` works are waited for on the current stream, in any order."""
        return False

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int | None = None) -> DispatchHandle | LowLatencyHandle | LocalDenseHandle:
        """Start the dispatch (low-latency when ``capacity`` is set). With ``ep_size == 1`` nothing is sent, and
        where the platform picks the token-row layout (``TorchLowLatencyAllToAll.uses_token_rows`` at ``M``, the
        capacity, else N) the tokens stay whole instead of being sorted into pairs. Raises ValueError: N > capacity."""
        rows = hidden.shape[0] if capacity is None else capacity
        if self.ep_size == 1 and self.low_latency.uses_token_rows(rows, topk_ids.shape[1], hidden):
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
    (``MoeCommConfig``; the same on every rank). The rank's platform builds it
    (:meth:`~raymoe.platform.interface.Platform.create_dispatcher`).

    Attributes:
        name: ``"torch"`` or a registered backend (``"deepep"``). mode: ``"normal"``, ``"low_latency"`` or
            ``"auto"``. num_max_dispatch_tokens_per_rank: tokens one rank may send in a low-latency step.
    """

    name: str = "torch"
    mode: str = "auto"
    num_max_dispatch_tokens_per_rank: int = 256
