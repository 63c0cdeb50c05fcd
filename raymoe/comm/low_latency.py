"""Low-latency (fixed-shape) MoE dispatch/combine over ``torch.distributed``, in the style of DeepEP's
low-latency mode (``Buffer.low_latency_dispatch`` / ``low_latency_combine``).

Every rank of a step uses the same per-rank capacity ``M`` (tokens a rank may send, chosen once by the driver:
the decode-graph bucket, or the busiest DP group's token count). Every buffer shape then depends on ``M`` only,
routing is counted on the device (no ``bincount(...).tolist()``, no exchange of counts before the data), and
each direction is one equal-split ``all_to_all_single``. With ``Q = M * min(k, E_local)``, the most pairs one
rank can route to one peer (a token's top-k experts are distinct):

* dispatch, sender: pair ``(t, j)`` going to global expert ``g = topk_ids[t, j]`` (local expert ``e`` of peer
  ``d``) takes slot ``s`` = the number of earlier tokens of this rank routed to ``g`` (an exclusive cumsum of a
  one-hot on the device), and row ``first[g] + s`` of the message for ``d``, where ``first[g]`` counts this rank's
  pairs for ``d``'s experts before ``e``: each message holds its ``Q`` rows sorted by local expert, then, in a row
  of its own, the per-expert counts (int64). Every message is a whole number of rows, so the send buffer is one
  ``[ep * rows_per_peer, H]`` row matrix (one scatter fills it, one gather reads it; no per-element indexing).
* dispatch, receiver: the rows of expert ``e`` from source ranks ``r = 0..ep-1`` are packed expert after expert
  into ``[R_max, H]`` with ``R_max = ep * Q``, the most pairs a rank can receive
  (:class:`~raymoe.comm.expert_input.GroupedExpertRows`; segment ends [E_local] int32 stay on the device), so the
  experts run one grouped GEMM per projection over the received rows only.
* combine: the receiver gathers the expert outputs back into each source's message order, ``[ep, Q, H]``, and
  sends them back; the sender gathers its pairs' rows and applies the top-k weights, returning ``[N, H]``.

The bytes moved per direction are about ``ep * Q * H`` elements, used or not (DeepEP's messages are sized by
``M`` alike): more than the normal mode's ``N * k * H`` when the routing is uneven, traded for one collective per
direction and no host sync. Buffers are allocated uninitialized: unused rows carry arbitrary bytes that no valid
row ever reads. The index tensors that depend only on ``M`` (and ``k``) are built once per capacity and cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from raymoe.comm.ep_transport import EpTransport
from raymoe.comm.expert_input import GroupedExpertRows
from raymoe.comm.groups import ParallelGroups


@dataclass
class LowLatencyHandle:
    """State of one low-latency dispatch until its combine returns (one per MoE call; one per TBO child).

    Attributes:
        num_tokens, top_k, capacity: N, k and the per-rank capacity M of this call; dtype, hidden_size: of the rows.
        topk_weights: [N, k] weights the combine applies. slot_rows: [N * k] int64 row of each pair in the
            ``[ep * Q, H]`` matrix of messages (``d * Q + first[g] + s``, module docstring); the combine answers in
            that layout.
        payload: uint8 [ep, B] received messages (rows, then the counts row) until ``dispatch_b`` unpacks them.
        unpack_index: [ep * Q] int64 row of the packed expert input holding each message row (built in
            ``dispatch_b``, used by the combine).
        combined: the returned rows [ep, Q * H] once the combine is posted. works: pending collectives.
    """

    num_tokens: int
    top_k: int
    capacity: int
    dtype: torch.dtype
    hidden_size: int
    topk_weights: torch.Tensor
    slot_rows: torch.Tensor
    payload: torch.Tensor | None = None
    unpack_index: torch.Tensor | None = None
    combined: torch.Tensor | None = None
    works: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class _Geometry:
    """Shape constants of one capacity ``M`` (and top-k, hidden size, dtype), with the index tensors that depend
    on nothing else; built once per capacity (:meth:`TorchLowLatencyAllToAll.geometry`).

    Attributes:
        peer_rows: ``Q = M * min(k, E_local)``, data rows of one message (and of one combine answer).
        rows_per_peer: rows of one dispatch message: ``Q`` data rows plus the counts row(s).
        counts_offset: byte offset of the int64 counts [E_local] in a message.
        peer_bytes: bytes of one dispatch message (``rows_per_peer`` rows of ``H`` elements).
        max_rows: ``R_max = ep * Q``, rows of the packed expert input.
        packed_pos: [R_max] int64 ``0..R_max-1``. message_pos: [ep, Q] int64, each row ``0..Q-1``.
        peers: [ep, 1] int64 ``0..ep-1``.
    """

    peer_rows: int
    rows_per_peer: int
    counts_offset: int
    peer_bytes: int
    max_rows: int
    packed_pos: torch.Tensor
    message_pos: torch.Tensor
    peers: torch.Tensor


def _aligned(nbytes: int, align: int = 8) -> int:
    return (nbytes + align - 1) // align * align


class TorchLowLatencyAllToAll:
    """Fixed-shape dispatch/combine with equal-split all-to-alls over the EP group's transport
    (:class:`~raymoe.comm.ep_transport.EpTransport`: shared memory between CPU ranks of one node, else gloo on CPU
    and NCCL on GPU).

    Args:
        groups: the rank's process groups; ``groups.ep_group`` is used (never the world group).
        num_experts: total routed experts E (divisible by ``ep_size``); rank r owns ``[r * E_local, (r+1) * E_local)``.
    """

    def __init__(self, groups: ParallelGroups, num_experts: int):
        self.groups = groups
        self.ep_size = groups.ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // groups.ep_size
        self.transport = EpTransport(groups) if groups.ep_size > 1 else None
        self._geometries: dict[tuple, _Geometry] = {}

    def geometry(self, capacity: int, top_k: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> _Geometry:
        """The message layout and constant index tensors of one capacity (cached: a step's capacity is the
        decode-graph bucket or the batch size, so few distinct values occur)."""
        key = (capacity, top_k, hidden_size, dtype, device)
        geo = self._geometries.get(key)
        if geo is None:
            ep, el = self.ep_size, self.num_local_experts
            q = capacity * min(top_k, el)
            row_bytes = hidden_size * dtype.itemsize
            counts_offset = _aligned(q * row_bytes)
            unit = math.lcm(row_bytes, 8)  # whole rows, and int64-aligned counts in every message
            peer_bytes = _aligned(counts_offset + 8 * el, unit)
            rows_per_peer = peer_bytes // row_bytes
            geo = _Geometry(q, rows_per_peer, counts_offset, peer_bytes, ep * q,
                            torch.arange(ep * q, device=device), torch.arange(q, device=device).repeat(ep, 1),
                            torch.arange(ep, device=device).view(ep, 1))
            self._geometries[key] = geo
        return geo

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int) -> LowLatencyHandle:
        """Place each routing pair in its peer's message and start the exchange.

        Args:
            hidden: [N, H] this rank's tokens (N <= ``capacity``; N may be 0).
            topk_ids: [N, k] int64 global expert ids (distinct per token). topk_weights: [N, k] hidden dtype.
            capacity: M, tokens per rank; the same on every rank of the step.
        Raises:
            ValueError: N > capacity.
        """
        n, k = topk_ids.shape
        if n > capacity:
            raise ValueError(f"low-latency dispatch of {n} tokens exceeds the per-rank capacity {capacity}")
        ep, el, h = self.ep_size, self.num_local_experts, hidden.shape[1]
        geo = self.geometry(capacity, k, h, hidden.dtype, hidden.device)
        onehot = torch.zeros(n, self.num_experts, dtype=torch.int64, device=hidden.device)
        onehot.scatter_(1, topk_ids, 1)
        slots = (onehot.cumsum(0) - onehot).gather(1, topk_ids)                  # [N, k] slot among g's tokens
        counts = onehot.sum(0).view(ep, el)                                       # [peer, E_local]
        first = (counts.cumsum(1) - counts).view(-1)                              # [E] first row of g in its message
        dest = torch.div(topk_ids, el, rounding_mode="floor")                     # [N, k] peer of each pair
        row = first.index_select(0, topk_ids.view(-1)).view(n, k) + slots         # [N, k] row in the message, < Q
        payload = torch.empty(ep, geo.peer_bytes, dtype=torch.uint8, device=hidden.device)
        rows = payload.view(hidden.dtype).view(ep * geo.rows_per_peer, h)       # every message, as rows
        rows.index_put_((dest * geo.rows_per_peer + row,), hidden.unsqueeze(1).expand(n, k, h))
        payload[:, geo.counts_offset:geo.counts_offset + 8 * el].view(torch.int64).copy_(counts)
        handle = LowLatencyHandle(n, k, capacity, hidden.dtype, h, topk_weights,
                                  (dest * geo.peer_rows + row).view(-1))
        if ep == 1:
            handle.payload = payload
            return handle
        handle.payload = torch.empty_like(payload)
        handle.works = [self.transport.all_to_all_equal(handle.payload, payload)]
        return handle

    def dispatch_b(self, handle: LowLatencyHandle) -> GroupedExpertRows:
        """Wait for the dispatch and pack the received rows expert after expert: ``x`` [R_max, H], ``ends``
        [E_local] int32 (:class:`~raymoe.comm.expert_input.GroupedExpertRows`)."""
        for w in handle.works:
            w.wait()
        handle.works = []
        ep, el, h = self.ep_size, self.num_local_experts, handle.hidden_size
        geo = self.geometry(handle.capacity, handle.top_k, h, handle.dtype, handle.payload.device)
        payload, handle.payload = handle.payload, None
        rows = payload.view(handle.dtype).view(ep * geo.rows_per_peer, h)
        per_src = payload[:, geo.counts_offset:geo.counts_offset + 8 * el].view(torch.int64)  # [src, E_local]
        src_end = per_src.cumsum(1)                                   # [src, E_local] end of e in src's message
        src_first = src_end - per_src
        count = per_src.t().reshape(-1)                               # [E_local * ep]: segment e * ep + src
        end = count.cumsum(0)
        start = end - count
        # packed row p belongs to the segment whose end is the first one above p (padding rows: the last one)
        seg = torch.searchsorted(end, geo.packed_pos, right=True).clamp_(max=el * ep - 1)
        expert = torch.div(seg, ep, rounding_mode="floor")
        src = seg - expert * ep
        src_row = (geo.packed_pos - start[seg] + src_first[src, expert]).clamp_(0, geo.peer_rows - 1)
        x = rows.index_select(0, src * geo.rows_per_peer + src_row)                     # [R_max, H]
        # message row j of source r -> its packed row, for the combine (unused rows point at some valid row)
        e_of = torch.searchsorted(src_end, geo.message_pos, right=True).clamp_(max=el - 1)
        seg_of = e_of * ep + geo.peers                                                   # [src, Q]
        packed = start[seg_of] + geo.message_pos - src_first.gather(1, e_of)
        handle.unpack_index = packed.clamp_(0, geo.max_rows - 1).view(-1)
        return GroupedExpertRows(x, end.view(el, ep)[:, -1].to(torch.int32), ep * handle.capacity)

    def combine_a(self, handle: LowLatencyHandle, expert_out: torch.Tensor) -> None:
        """Start sending expert outputs ``expert_out`` [R_max, H] (packed, as dispatched) back."""
        ep = self.ep_size
        back = expert_out.index_select(0, handle.unpack_index).view(ep, -1)        # each source's message order
        handle.unpack_index = None
        if ep == 1:
            handle.combined = back
            return
        handle.combined = torch.empty_like(back)
        handle.works = [self.transport.all_to_all_equal(handle.combined, back)]

    def combine_b(self, handle: LowLatencyHandle) -> torch.Tensor:
        """Wait for the combine; returns ``sum_j topk_weights[t, j] * expert_out(t, j)`` as [N, H]."""
        for w in handle.works:
            w.wait()
        handle.works = []
        back, handle.combined = handle.combined, None
        assert back is not None, "combine_a must run before combine_b"
        h = handle.hidden_size
        pairs = back.view(-1, h).index_select(0, handle.slot_rows).view(handle.num_tokens, handle.top_k, h)
        return (pairs * handle.topk_weights.unsqueeze(-1)).sum(dim=1)
