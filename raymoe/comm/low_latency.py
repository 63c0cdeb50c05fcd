"""Low-latency (fixed-shape) MoE dispatch/combine over ``torch.distributed``, in the gather-scatter layout: every
rank's tokens go to every peer once, and each peer's partial sums come back once.

DeepEP's low-latency mode (``Buffer.low_latency_dispatch`` / ``low_latency_combine``) fixes every shape by the
per-rank capacity ``M`` (tokens a rank may send, chosen once by the driver: the decode-graph bucket, or the
busiest DP group's token count), counts routing on the device and never syncs with the host. This backend keeps
those properties with the all-gather / reduce-scatter exchange SGLang's DP attention and vLLM's
``allgather_reducescatter`` all-to-all put around expert-parallel MoE:

* dispatch (an all-gather over the EP transport): each rank sends the same message to every peer: its ``M``
  token rows [M, H] (rows ``N..M-1`` unused), then its routing, ``topk_ids`` [M, k] int64 (unused rows hold
  ``E``, an expert nobody owns; a graph's padding rows hold ``NO_EXPERT``, -1, nobody's either) and
  ``topk_weights`` [M, k] in the hidden dtype. The receiver maps each of the ``P = ep * M * k`` received pairs to
  its local expert (``E_local`` for another rank's expert or no expert), sorts the pairs
  by it on the device, and hands the experts the token rows in that order
  (:class:`~raymoe.comm.expert_input.GroupedExpertRows`, segment ends [E_local] int32 on the device), so one
  grouped GEMM per projection runs over this rank's pairs only.
* combine (a reduce-scatter: an equal-split all-to-all, then a sum): the receiver weights its pairs' outputs,
  sums them per token into [ep * M, H] partial sums and sends source ``r`` its [M, H]; each rank sums the
  ``ep`` partial sums of its tokens.

Where the rank's platform says so (:meth:`~raymoe.platform.interface.Platform.use_token_rows`: small steps on
CPU, ``raymoe.platform.cpu.expert_layout``), the receiver skips the sort: it hands the experts every gathered token
row once with its own routing, read in place from the messages (:class:`~raymoe.comm.expert_input.RoutedTokenRows`),
and the experts answer the weighted per-token sums the combine sends back as they are.

Bytes per peer and direction: ``M`` rows plus the routing. The layout before it sent each (token, expert) pair
to its expert's rank, in messages of ``M * min(k, E_local)`` rows (the worst case of one rank sending every pair
to one peer), and packed the received pairs per expert with about twice the index ops; on two CPU ranks a decode
step took 0.35-1.0 ms longer with it. Fixed-size messages are sent whole, so the pair layout moves fewer bytes only
where ``k`` or ``E_local`` is 1.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from raymoe.comm.ep_transport import ep_transport_of
from raymoe.comm.expert_input import GroupedExpertRows, RoutedTokenRows
from raymoe.comm.groups import ParallelGroups


class LowLatencyOps(Protocol):
    """What the low-latency exchange asks of the rank's platform (:class:`~raymoe.platform.interface.Platform`
    has both): the expert layout of a step, and how to write a message."""

    def use_token_rows(self, ep_size: int, capacity: int, top_k: int, num_experts: int, expert_row_macs: int,
                       hidden: torch.Tensor) -> bool: ...

    def write_bytes(self, dst: torch.Tensor, offset: int, src: torch.Tensor) -> None: ...

    def stream_scope(self) -> Hashable:
        """What a device constant cached by the exchange is valid in (part of its cache key): the current stream
        where the device has several (a constant made by one stream's kernel is not ordered before another
        stream's kernels: a two-batch-overlap child on a second stream builds its own), else None."""
        ...


@dataclass
class LowLatencyHandle:
    """State of one low-latency dispatch until its combine returns (one per MoE call; one per TBO child).

    Attributes:
        num_tokens, capacity: this rank's N and the step's per-rank capacity M. top_k, hidden_size, dtype: of
            the call.
        payload: uint8 [ep, B] received messages until ``dispatch_b`` unpacks them.
        order: [ep * M * k] int64 received pair (``(src * M + t) * k + j``) at each sorted position.
        dense: the step uses the token-row layout (:class:`~raymoe.comm.expert_input.RoutedTokenRows`).
        mine: [ep, M, k, 1] bool, pairs routed to this rank's experts. weights: [ep, M, k, 1] their top-k weights
            (a view of the received messages). Both unused in the dense layout.
        partial: [ep, M * H] per-source partial sums once the combine is posted. works: pending collectives.
    """

    num_tokens: int
    capacity: int
    top_k: int
    hidden_size: int
    dtype: torch.dtype
    dense: bool = False
    payload: torch.Tensor | None = None
    order: torch.Tensor | None = None
    mine: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    works: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class _Geometry:
    """Message layout of one capacity ``M`` (with top-k, hidden size, dtype); cached per capacity.

    Attributes:
        hidden_bytes: bytes of the ``M`` token rows that open a message.
        ids_offset, weights_offset, weights_end: byte range of ``topk_ids`` [M, k] int64, then of ``topk_weights``
            [M, k]. nbytes: bytes of a message (whole rows of ``H`` elements).
        pair_rows: [ep * M * k] int64 row of the received rows matrix holding each pair's token.
        local_experts: [E_local] int64 ``0..E_local-1`` (segment ends by ``searchsorted``).
    """

    hidden_bytes: int
    ids_offset: int
    weights_offset: int
    weights_end: int
    nbytes: int
    message_rows: int
    pair_rows: torch.Tensor
    local_experts: torch.Tensor


def check_capacity(num_tokens: int, capacity: int) -> None:
    """Raise ValueError when a rank dispatches more tokens than the step's per-rank capacity."""
    if num_tokens > capacity:
        raise ValueError(f"low-latency dispatch of {num_tokens} tokens exceeds the per-rank capacity {capacity}")


def _aligned(nbytes: int, align: int) -> int:
    return (nbytes + align - 1) // align * align


class TorchLowLatencyAllToAll:
    """Fixed-shape dispatch/combine by all-gather and reduce-scatter (module docstring) over the EP group's transport
    (:class:`~raymoe.comm.transport.EpTransport`: the platform's, such as shared memory between CPU ranks of one
    node, else ``torch.distributed``).

    Args:
        groups: the rank's process groups; its EP transport is used (never the world group).
        num_experts: total routed experts E (divisible by ``ep_size``); rank r owns ``[r * E_local, (r+1) * E_local)``.
        ops: the rank's platform (the step's expert layout, message writes).
        expert_row_macs: multiply-accumulates of one local expert on one row, ``3 * H * I_local`` (0: unknown).
    """

    def __init__(self, groups: ParallelGroups, num_experts: int, ops: LowLatencyOps, expert_row_macs: int = 0):
        self.ep_size = groups.ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // groups.ep_size
        self.transport = ep_transport_of(groups)
        self.ops = ops
        start = self.first_expert = groups.ep_rank * self.num_local_experts
        # global expert id (E: an unused row) -> local expert, E_local for every expert of another rank
        remap = torch.full((num_experts + 1,), self.num_local_experts, dtype=torch.int64)
        remap[start:start + self.num_local_experts] = torch.arange(self.num_local_experts)
        self._remap = {(torch.device("cpu"), None): remap}  # device caches: keyed by (device, ops.stream_scope())
        self._geometries: dict[tuple, _Geometry] = {}
        self.expert_row_macs = expert_row_macs
        self._pad_ids: dict[tuple, torch.Tensor] = {}  # E, E, ...: the ids of unused message rows

    def uses_token_rows(self, capacity: int, top_k: int, hidden: torch.Tensor) -> bool:
        """Whether a step of per-rank capacity ``capacity`` (tokens like ``hidden``, top-``top_k`` routing) answers
        ``RoutedTokenRows``: the platform's choice (:meth:`LowLatencyOps.use_token_rows`)."""
        return self.ops.use_token_rows(self.ep_size, capacity, top_k, self.num_experts, self.expert_row_macs, hidden)

    def remap(self, device: torch.device) -> torch.Tensor:
        """[E + 1] int64: global expert id -> local expert id, ``E_local`` where another rank owns it. Indexed by
        ``NO_EXPERT`` (-1) it gives its last entry, that of id ``E`` (no rank's): ``E_local``."""
        key = (device, self.ops.stream_scope())
        table = self._remap.get(key)
        if table is None:
            table = self._remap[key] = self._remap[(torch.device("cpu"), None)].to(device, non_blocking=True)
        return table

    def geometry(self, capacity: int, top_k: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> _Geometry:
        """The message layout and constant index tensors of one capacity (cached per device and stream scope)."""
        key = (capacity, top_k, hidden_size, dtype, device, self.ops.stream_scope())
        geo = self._geometries.get(key)
        if geo is None:
            m, k, ep = capacity, top_k, self.ep_size
            row_bytes = hidden_size * dtype.itemsize
            ids_offset = _aligned(m * row_bytes, 8)
            weights_offset = ids_offset + 8 * m * k
            weights_end = weights_offset + m * k * dtype.itemsize
            unit = math.lcm(row_bytes, 8)  # whole rows, and int64-aligned routing in every message
            nbytes = _aligned(weights_end, unit)
            routing_rows = nbytes // row_bytes - m
            token = torch.arange(ep * m * k, device=device) // k                       # gathered token of a pair
            pair_rows = token + (token // m) * routing_rows                            # its row in the messages
            geo = _Geometry(m * row_bytes, ids_offset, weights_offset, weights_end, nbytes, m + routing_rows, pair_rows,
                            torch.arange(self.num_local_experts, device=device))
            self._geometries[key] = geo
        return geo

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int) -> LowLatencyHandle:
        """Write this rank's tokens and routing into one message and start sending it to every peer.

        Args:
            hidden: [N, H] this rank's tokens (N <= ``capacity``; N may be 0).
            topk_ids: [N, k] int64 global expert ids, or ``NO_EXPERT`` for a pair of no expert. topk_weights:
                [N, k] hidden dtype.
            capacity: M, tokens per rank; the same on every rank of the step.
        Raises:
            ValueError: N > capacity.
        """
        n, k = topk_ids.shape
        check_capacity(n, capacity)
        m, h, ep = capacity, hidden.shape[1], self.ep_size
        geo = self.geometry(m, k, h, hidden.dtype, hidden.device)
        message = torch.empty(geo.nbytes, dtype=torch.uint8, device=hidden.device)
        self._pack(message, geo, m, hidden, topk_ids, topk_weights)
        handle = LowLatencyHandle(n, m, k, h, hidden.dtype, dense=self.uses_token_rows(m, k, hidden))
        if ep == 1:
            handle.payload = message.view(1, -1)
            return handle
        handle.payload = torch.empty(ep, geo.nbytes, dtype=torch.uint8, device=hidden.device)
        handle.works = [self.transport.all_gather(handle.payload, message)]
        return handle

    def _pack(self, message: torch.Tensor, geo: _Geometry, m: int, hidden: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Write ``message`` (uint8 [nbytes], the layout of ``geo`` for capacity ``m``): the N token rows,
        ``topk_ids`` then ``E`` for the unused rows, ``topk_weights``, through the platform's
        :meth:`LowLatencyOps.write_bytes` (device copies on a GPU's stream, which a graph captures; one ``memmove``
        per part on CPU, where a tensor call costs more than copying a decode step's few kilobytes)."""
        n, k = topk_ids.shape
        write = self.ops.write_bytes
        write(message, 0, hidden)
        write(message, geo.ids_offset, topk_ids.to(torch.int64))
        if m > n:
            write(message, geo.ids_offset + 8 * n * k, self._pad_ids_for((m - n) * k, message.device))
        write(message, geo.weights_offset, topk_weights.to(hidden.dtype))

    def _pad_ids_for(self, count: int, device: torch.device) -> torch.Tensor:
        """``count`` copies of ``E`` (an expert nobody owns), int64 on ``device``, from a buffer kept per device and
        stream scope."""
        key = (device, self.ops.stream_scope())
        pad = self._pad_ids.get(key)
        if pad is None or pad.numel() < count:
            pad = self._pad_ids[key] = torch.full((count,), self.num_experts, dtype=torch.int64, device=device)
        return pad[:count]

    def dispatch_b(self, handle: LowLatencyHandle) -> GroupedExpertRows | RoutedTokenRows:
        """Wait for every peer's message; returns this rank's pairs as token rows sorted by local expert,
        ``x`` [ep * M * k, H] with ``ends`` [E_local] int32 (rows from ``ends[-1]`` on belong to other ranks'
        experts and are padding to the experts), or for a dense step every gathered token row with its routing,
        read in place from the messages (:class:`~raymoe.comm.expert_input.RoutedTokenRows`, [ep, M, *])."""
        for w in handle.works:
            w.wait()
        handle.works = []
        m, k, h, dtype = handle.capacity, handle.top_k, handle.hidden_size, handle.dtype
        payload, handle.payload = handle.payload, None
        geo = self.geometry(m, k, h, dtype, payload.device)
        ids = payload[:, geo.ids_offset:geo.weights_offset].view(torch.int64)               # [ep, M * k]
        weights = payload[:, geo.weights_offset:geo.weights_end].view(dtype)              # [ep, M * k]
        rows = payload.view(dtype).view(-1, h)                                            # every message, as rows
        if handle.dense:  # the messages in place: [ep, M, H] rows, [ep, M, k] routing
            x = rows.view(self.ep_size, geo.message_rows, h)[:, :m]
            return RoutedTokenRows(x, ids.view(self.ep_size, m, k), weights.view(self.ep_size, m, k),
                                   self.first_expert)
        local = self.remap(payload.device)[ids]                     # E_local = not ours (NO_EXPERT included)
        local = local.view(-1)                                                            # [P]
        handle.mine = (local < self.num_local_experts).view(-1, m, k, 1)
        handle.weights = weights.view(-1, m, k, 1)
        local, handle.order = torch.sort(local, stable=True)
        ends = torch.searchsorted(local, geo.local_experts, right=True, out_int32=True)
        x = rows.index_select(0, geo.pair_rows.index_select(0, handle.order))
        return GroupedExpertRows(x, ends, self.ep_size * m)

    def combine_a(self, handle: LowLatencyHandle, expert_out: torch.Tensor) -> None:
        """Weight this rank's pair outputs (``expert_out`` [ep * M * k, H], as dispatched), sum them per token
        and start sending each source its [M, H] partial sums (a dense step's ``expert_out`` [ep * M, H] already
        holds them).

        The outputs go back to the received pair order and are summed over k with a plain reduction (no atomic
        adds), so the result is the same run to run on every device. Rows of other ranks' pairs (padding to the
        experts, any value) are masked out, never multiplied into the sum.
        """
        m, h, k, ep = handle.capacity, handle.hidden_size, handle.top_k, self.ep_size
        if handle.dense:  # the experts answered the weighted sums per gathered token: [ep * M, H]
            partial = expert_out.contiguous().view(ep, m, h)
        else:
            back = torch.empty_like(expert_out).index_copy_(0, handle.order, expert_out).view(-1, m, k, h)
            partial = torch.where(handle.mine, back * handle.weights, 0.0).sum(dim=2)         # [ep, M, H]
        handle.order = handle.mine = handle.weights = None
        if ep == 1:
            handle.partial = partial.view(1, -1)
            return
        handle.partial = torch.empty(ep, m * h, dtype=partial.dtype, device=partial.device)
        handle.works = [self.transport.all_to_all_equal(handle.partial, partial.view(ep, -1))]

    def combine_b(self, handle: LowLatencyHandle) -> torch.Tensor:
        """Wait for the peers' partial sums; returns ``sum_j topk_weights[t, j] * expert_out(t, j)`` as [N, H]."""
        for w in handle.works:
            w.wait()
        handle.works = []
        partial, handle.partial = handle.partial, None
        assert partial is not None, "combine_a must run before combine_b"
        m, h = handle.capacity, handle.hidden_size
        return partial.view(-1, m, h).sum(dim=0)[:handle.num_tokens]
