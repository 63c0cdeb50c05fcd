"""MoE dispatcher over DeepEP's ``deep_ep.Buffer`` (GPU; ``deep_ep`` is imported lazily, only when built).

The four halves of ``raymoe.comm.dispatcher`` map onto DeepEP (v1.2.x API) as follows.

Normal mode (``capacity`` None; data-dependent shapes, the host waits for the received counts):

* ``dispatch_a``: ``get_dispatch_layout`` then ``dispatch(async_finish=True)``. DeepEP sends each *token* once
  per destination rank with its top-k ids rewritten to that rank's local ids (-1 for other ranks' experts);
  the returned ``EventOverlap`` is kept in the handle.
* ``dispatch_b``: ``event.current_stream_wait()``, then expand the received tokens ``recv_x`` [R_tok, H] into
  our :class:`~raymoe.comm.expert_input.ExpertRows`, one row per (received token, local expert) pair.
* ``combine_a``: DeepEP's ``combine`` sums the rows that ranks send back for a token but does not weight them,
  so the pair outputs are first reduced to one row per received token, weighted by ``recv_topk_weights``;
  then ``combine(async_finish=True)``. Single-batch overlap parts (``num_parts > 1``) are buffered and the
  combine is sent with the last part: one DeepEP combine serves one dispatch handle, so the parts give the
  plain path's result but no combine overlap.
* ``combine_b``: wait for the event; the combined rows [N, H] are already the top-k weighted sums.

Low-latency mode (``capacity`` M; fixed shapes, DeepEP's hook-based receive, no SM spent waiting):

* ``dispatch_a``: ``low_latency_dispatch(use_fp8=..., return_recv_hook=True)`` (only the send is issued). With
  ``use_fp8`` (an FP8 checkpoint's experts, which DeepGEMM's masked FP8 GEMM runs) DeepEP quantizes each token per
  group of 128 channels before sending, halving the dispatch bytes, and the rows arrive as FP8 with their scales
  (``MaskedExpertRows.x_scale``), which the experts read as they are.
* ``dispatch_b``: call the hook, return ``MaskedExpertRows(recv_x, recv_count, max_rows)``; ``recv_x`` is
  [E_local, M_max * ep, H]: DeepEP sizes it by the buffer's ``num_max_dispatch_tokens_per_rank`` M_max, not by
  the step's capacity (M <= M_max is checked); ``max_rows = ep * M * min(k, E_local)`` bounds the valid rows of
  the step, so the experts can run over them alone (``raymoe.platform.cuda.experts``).
* ``combine_a`` / ``combine_b``: ``low_latency_combine(return_recv_hook=True)`` (it applies the top-k weights),
  then its hook.

Every call gets its own handle (two-batch overlap runs two in flight). DeepEP keeps two low-latency buffers,
so at most two low-latency kernels may await their receive; the shared buffer refuses a third
(``raymoe.platform.cuda.deepep_buffer``) and cleans the low-latency buffer when a step follows a normal-mode one.

Dtypes: DeepEP's combine and low-latency kernels take bfloat16 rows (top-k weights float32, cast here); run
models in bfloat16 with this backend.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from raymoe.comm.expert_input import ExpertRows, MaskedExpertRows
from raymoe.comm.groups import ParallelGroups
from raymoe.platform.cuda.deepep_buffer import (
    LOW_LATENCY,
    NORMAL,
    DeepEPBufferSpec,
    SharedDeepEPBuffer,
    hidden_bytes_of,
    shared_deepep_buffer,
)


@dataclass
class DeepEPNormalHandle:
    """One normal-mode DeepEP call, from ``dispatch_a`` to ``combine_b``.

    Attributes:
        num_tokens: N of this rank. deepep_handle: DeepEP's opaque dispatch handle (for ``combine``).
        event: the pending ``EventOverlap`` (dispatch, then combine). recv_x [R_tok, H], recv_topk_idx [R_tok, k]
            int64 local ids or -1, recv_topk_weights [R_tok, k] float32: DeepEP's received tokens. num_pairs: R,
            the received (token, local expert) pairs (the sum of DeepEP's ``num_recv_tokens_per_expert_list``).
        pair_token, pair_weight: [R] int64 received-token row and float32 weight of each expert row (built by
            ``dispatch_b``). recv_counts: ``[R]``, the single chunk single-batch-overlap parts slice
            (``raymoe.comm.all_to_all.part_row_index``). parts: expert outputs of the parts received so far.
        combined: the combine's output [N, H] once posted.
    """

    num_tokens: int
    deepep_handle: Any
    event: Any
    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    num_pairs: int = 0
    pair_token: torch.Tensor | None = None
    pair_weight: torch.Tensor | None = None
    recv_counts: list[int] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    combined: torch.Tensor | None = None


@dataclass
class DeepEPLowLatencyHandle:
    """One low-latency DeepEP call. ``topk_ids`` [N, k] int64 and ``topk_weights`` [N, k] float32 go to the
    combine; ``deepep_handle`` is DeepEP's; ``hook`` receives the pending kernel held in low-latency ``slot``;
    ``result`` is what the hook makes valid (``MaskedExpertRows`` of the dispatch, then the combined [N, H])."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    deepep_handle: Any = None
    hook: Any = None
    slot: int | None = None
    result: Any = None


class DeepEPDispatcher:
    """Dispatch/combine through the process's shared ``deep_ep.Buffer`` of the EP group.

    Args:
        groups: the rank's process groups (``ep_group``, ``ep_size >= 2``). num_experts: routed experts E.
        hidden_size: H. dtype: hidden-state dtype (sizes the buffer; DeepEP moves bfloat16).
        num_max_dispatch_tokens_per_rank: M_max, bound of a low-latency step's per-rank tokens (same on all ranks).
        low_latency: whether low-latency steps may run (``a2a_mode`` "low_latency"/"auto"); False skips the RDMA
            buffer.
        use_fp8: low-latency dispatches send FP8 rows with per-token-group scales (DeepEP's ``use_fp8``).
        buffer_factory: a class with ``deep_ep.Buffer``'s constructor and static methods (default
            ``deep_ep.Buffer``; tests pass a CPU double).
    Raises:
        ImportError: ``deep_ep`` is not installed (and no ``buffer_factory``).
        ValueError: ``ep_size < 2`` (DeepEP has no single-rank config) or E not divisible by it, or ``use_fp8``
            without bfloat16 rows whose ``hidden_size`` is a multiple of 512 (what DeepEP's FP8 dispatch takes).
    """

    def __init__(self, groups: ParallelGroups, num_experts: int, *, hidden_size: int,
                 dtype: torch.dtype = torch.bfloat16, num_max_dispatch_tokens_per_rank: int = 256,
                 low_latency: bool = True, buffer_factory: Any = None, use_fp8: bool = False):
        if groups.ep_size < 2:
            raise ValueError(f"the deepep all-to-all backend needs an expert-parallel group of >= 2 ranks, "
                             f"got ep_size={groups.ep_size}")
        if num_experts % groups.ep_size:
            raise ValueError(f"num_experts {num_experts} is not divisible by ep_size {groups.ep_size}")
        if use_fp8 and (dtype != torch.bfloat16 or hidden_size % 512):
            raise ValueError(f"DeepEP's FP8 dispatch takes bfloat16 rows with hidden % 512 == 0, got {dtype}, "
                             f"hidden {hidden_size}")
        self.use_fp8 = use_fp8
        if buffer_factory is None:
            try:
                import deep_ep  # lazy: CUDA + NVSHMEM build, never needed on CPU
            except ImportError as e:
                raise ImportError("a2a_backend='deepep' needs the deep_ep package (DeepEP, built from source with "
                                  "NVSHMEM; see README, 'GPU backends')") from e
            buffer_factory = deep_ep.Buffer
        self.ep_size = groups.ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // groups.ep_size
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        spec = DeepEPBufferSpec(hidden_size, hidden_bytes_of(hidden_size, dtype), num_experts,
                                num_max_dispatch_tokens_per_rank, low_latency)
        self.shared: SharedDeepEPBuffer = shared_deepep_buffer(groups.ep_group, groups.ep_size, spec, buffer_factory)

    @property
    def buffer(self) -> Any:
        return self.shared.buffer

    def receives_through_hooks(self, capacity: int | None) -> bool:
        """True for low-latency steps (``capacity`` set): their receives are DeepEP hooks, called in launch order
        on one stream."""
        return capacity is not None

    def prepare_graph_replay(self) -> None:
        """Before a replay of a decode graph captured with low-latency kernels: enter the low-latency mode on the
        host, cleaning DeepEP's low-latency buffer after a normal-mode step (a collective; every rank replays the
        same step). The replay runs only the captured kernels, and the capture made no clean; without this a
        decode replayed after a prefill would run on a dirty buffer."""
        if self.shared.spec.low_latency:
            self.shared.enter_mode(LOW_LATENCY)

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int | None = None) -> DeepEPNormalHandle | DeepEPLowLatencyHandle:
        """Start the dispatch of ``hidden`` [N, H] routed by ``topk_ids`` [N, k] int64 with ``topk_weights``
        [N, k]; low-latency when ``capacity`` (tokens per rank, the same on every rank) is set.

        Raises:
            ValueError: N > capacity, or capacity > the buffer's ``num_max_dispatch_tokens_per_rank``, or a
                low-latency step on a dispatcher built without the low-latency mode.
            DeepEPInFlightError: a third low-latency result in flight.
        """
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        if capacity is None:
            return self._normal_dispatch_a(hidden.contiguous(), ids, weights)
        n = hidden.shape[0]
        if n > capacity:
            raise ValueError(f"low-latency dispatch of {n} tokens exceeds the per-rank capacity {capacity}")
        if capacity > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(f"low-latency capacity {capacity} exceeds the DeepEP buffer's "
                             f"num_max_dispatch_tokens_per_rank {self.num_max_dispatch_tokens_per_rank}")
        if not self.shared.spec.low_latency:
            raise ValueError("a low-latency step on a DeepEP buffer built for the normal mode only (a2a_mode)")
        self.shared.enter_mode(LOW_LATENCY)
        handle = DeepEPLowLatencyHandle(ids, weights)
        with self._low_latency_slot(handle):
            recv_x, recv_count, handle.deepep_handle, _, handle.hook = self.buffer.low_latency_dispatch(
                hidden.contiguous(), ids, self.num_max_dispatch_tokens_per_rank, self.num_experts,
                use_fp8=self.use_fp8, async_finish=False, return_recv_hook=True)
        max_rows = self.ep_size * capacity * min(ids.shape[1], self.num_local_experts)
        if self.use_fp8:  # (FP8 rows [E_local, T, H], float32 scales [E_local, T, H / 128])
            handle.result = MaskedExpertRows(recv_x[0], recv_count, max_rows, x_scale=recv_x[1])
        else:
            handle.result = MaskedExpertRows(recv_x, recv_count, max_rows)
        return handle

    @contextmanager
    def _low_latency_slot(self, handle: DeepEPLowLatencyHandle):
        """Hold a low-latency slot for the kernel launched inside; give it back if the launch raises."""
        handle.slot = self.shared.acquire_low_latency(handle)
        try:
            yield
        except BaseException:
            self.shared.release_low_latency(handle.slot, handle)
            handle.slot = None
            raise

    def _normal_dispatch_a(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> DeepEPNormalHandle:
        self.shared.enter_mode(NORMAL)
        per_rank, per_rdma_rank, per_expert, in_rank, layout_event = self.buffer.get_dispatch_layout(
            ids, self.num_experts, previous_event=None, async_finish=True, allocate_on_comm_stream=False)
        recv_x, recv_ids, recv_weights, per_expert, deepep_handle, event = self.buffer.dispatch(
            hidden, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=weights, previous_event=layout_event,
            async_finish=True, allocate_on_comm_stream=True)
        # DeepEP counts the received (token, local expert) pairs on the host (its CPU wait for the receive
        # counts; expert_alignment 1): dispatch_b selects them without another sync
        return DeepEPNormalHandle(hidden.shape[0], deepep_handle, event, recv_x, recv_ids, recv_weights,
                                  num_pairs=sum(per_expert))

    def dispatch_b(self, handle: DeepEPNormalHandle | DeepEPLowLatencyHandle) -> ExpertRows | MaskedExpertRows:
        """Wait for the dispatch: :class:`ExpertRows` (normal; rows ordered by received token, then top-k slot) or
        :class:`MaskedExpertRows` (low-latency; ``x`` [E_local, M_max * ep, H], ``counts`` [E_local] int32)."""
        if isinstance(handle, DeepEPLowLatencyHandle):
            self._receive(handle)
            return handle.result
        handle.event.current_stream_wait()
        handle.event = None
        k = handle.recv_topk_idx.shape[1]
        # the R valid pairs in token-major order: a stable sort puts them first, and R is the host count DeepEP
        # returned (a nonzero() would read R back from the device, a host sync per layer)
        invalid = (handle.recv_topk_idx < 0).reshape(-1).to(torch.uint8)
        pair = torch.argsort(invalid, stable=True)[:handle.num_pairs]     # [R] flat (token, slot) index
        tok, slot = pair // k, pair % k
        handle.pair_token = tok
        handle.pair_weight = handle.recv_topk_weights[tok, slot]
        handle.recv_counts = [handle.num_pairs]
        return ExpertRows(handle.recv_x.index_select(0, tok), handle.recv_topk_idx[tok, slot])

    def combine_a(self, handle: DeepEPNormalHandle | DeepEPLowLatencyHandle, expert_out: torch.Tensor,
                  part: int = 0, num_parts: int = 1) -> None:
        """Start the combine of ``expert_out`` (``dispatch_b``'s layout; with ``num_parts > 1`` the rows of part
        ``part``, sent together with the last part).

        Raises:
            ValueError: a low-latency combine in parts, or parts out of order.
            DeepEPInFlightError: a third low-latency result in flight.
        """
        if isinstance(handle, DeepEPLowLatencyHandle):
            if num_parts != 1:
                raise ValueError("a low-latency combine is sent in one part")
            with self._low_latency_slot(handle):
                handle.result, _, handle.hook = self.buffer.low_latency_combine(
                    expert_out.contiguous(), handle.topk_ids, handle.topk_weights, handle.deepep_handle,
                    async_finish=False, return_recv_hook=True)
            return
        if part != len(handle.parts) or part >= num_parts:
            raise ValueError(f"combine part {part} of {num_parts} out of order ({len(handle.parts)} sent)")
        handle.parts.append(expert_out)
        if part + 1 < num_parts:
            return
        rows = handle.parts[0] if num_parts == 1 else _reassemble(handle.parts, handle.recv_counts)
        handle.parts = []
        per_token = torch.zeros(handle.recv_x.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
        per_token.index_add_(0, handle.pair_token, rows.float() * handle.pair_weight.unsqueeze(1))
        self.shared.enter_mode(NORMAL)
        handle.combined, _, handle.event = self.buffer.combine(
            per_token.to(rows.dtype), handle.deepep_handle, topk_weights=None, async_finish=True)

    def combine_b(self, handle: DeepEPNormalHandle | DeepEPLowLatencyHandle) -> torch.Tensor:
        """Wait for the combine; returns ``sum_j topk_weights[t, j] * expert_out(t, j)`` as [N, H]."""
        if isinstance(handle, DeepEPLowLatencyHandle):
            self._receive(handle)
            return handle.result
        assert handle.combined is not None and handle.event is not None, "combine_a must run before combine_b"
        handle.event.current_stream_wait()
        handle.event = None
        return handle.combined

    def _receive(self, handle: DeepEPLowLatencyHandle) -> None:
        if handle.hook is None:
            raise RuntimeError("this low-latency DeepEP kernel was already received")
        handle.hook()
        self.shared.release_low_latency(handle.slot, handle)
        handle.hook = handle.slot = None


def _reassemble(parts: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """The full [R, H] rows from single-batch-overlap parts cut by ``part_row_index(counts, p, len(parts))``."""
    from raymoe.comm.all_to_all import part_row_index

    first = parts[0]
    rows = first.new_empty((sum(counts), first.shape[1]))
    for p, part in enumerate(parts):
        rows[part_row_index(counts, p, len(parts), first.device)] = part
    return rows
