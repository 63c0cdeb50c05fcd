"""Low-latency (fixed-shape) MoE dispatch/combine over ``torch.distributed``, in the style of DeepEP's
low-latency mode (``Buffer.low_latency_dispatch`` / ``low_latency_combine``).

Every rank of a step uses the same per-rank capacity ``M`` (tokens a rank may send, chosen once by the driver:
the decode-graph bucket, or the busiest DP group's token count). Every buffer shape then depends on ``M`` only,
routing is counted on the device (no ``bincount(...).tolist()``, no exchange of counts before the data), and
each direction is one equal-split ``all_to_all_single``:

* dispatch, sender: pair ``(t, j)`` going to global expert ``g = topk_ids[t, j]`` takes slot ``s`` = the number of
  earlier tokens of this rank routed to ``g`` (an exclusive cumsum of a one-hot on the device; top-k experts of a
  token are distinct, so ``s < M``). Row ``(g, s)`` of a send buffer ``[ep, E_local * M, H]`` gets the token, and
  the per-expert counts ride in the same message (one byte buffer per peer: rows, then int64 counts).
* dispatch, receiver: the rows of expert ``e`` from source ranks ``r = 0..ep-1`` are packed to the front of
  ``[E_local, ep * M, H]`` (:class:`~raymoe.comm.expert_input.MaskedExpertRows`; counts [E_local] int32 stay on
  the device), DeepEP's ``packed_recv_x`` / ``packed_recv_count`` layout.
* combine: the receiver un-packs the expert outputs into the same ``[ep, E_local * M, H]`` slot layout and sends
  it back; the sender gathers its pairs' rows and applies the top-k weights, returning ``[N, H]``.

The bytes moved per direction are ``ep * E_local * M * H`` elements (every slot, used or not): more than the
normal mode's ``N * k * H`` when few experts are hit, traded for one collective per direction and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raymoe.comm.ep_transport import EpTransport
from raymoe.comm.expert_input import MaskedExpertRows
from raymoe.comm.groups import ParallelGroups


@dataclass
class LowLatencyHandle:
    """State of one low-latency dispatch until its combine returns (one per MoE call; one per TBO child).

    Attributes:
        num_tokens, top_k, capacity: N, k and the per-rank capacity M of this call; dtype, hidden_size: of the rows.
        topk_weights: [N, k] weights the combine applies. slot_rows: [N * k] int64 row of each pair in the
            sender's ``[E * M, H]`` slot layout (``g * M + s``).
        payload: uint8 [ep, B] received message (rows then counts) until ``dispatch_b`` unpacks it.
        unpack_index: [ep, E_local, M] packed position of each slot (built in ``dispatch_b``, used by the combine).
        combined: the returned slot rows [ep, E_local * M, H] once the combine is posted. works: pending
            collectives.
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

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int) -> LowLatencyHandle:
        """Place each routing pair in its expert's slot and start the exchange.

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
        ep, el, h, m = self.ep_size, self.num_local_experts, hidden.shape[1], capacity
        onehot = torch.zeros(n, self.num_experts, dtype=torch.int64, device=hidden.device)
        onehot.scatter_(1, topk_ids, 1)
        slots = (onehot.cumsum(0) - onehot).gather(1, topk_ids)                  # [N, k]
        slot_rows = (topk_ids * m + slots).reshape(-1)                           # [N * k] in [0, E * M)
        counts = onehot.sum(0)                                                    # [E] int64
        row_bytes = el * m * h * hidden.element_size()
        hb = _aligned(row_bytes)
        payload = torch.zeros(ep, hb + 8 * el, dtype=torch.uint8, device=hidden.device)
        rows = payload[:, :row_bytes].view(hidden.dtype).view(ep, el * m, h)
        dest = torch.div(slot_rows, el * m, rounding_mode="floor")
        rows.index_put_((dest, slot_rows - dest * (el * m)), hidden.repeat_interleave(k, dim=0) if k > 1 else hidden)
        payload[:, hb:].view(torch.int64).copy_(counts.view(ep, el))
        handle = LowLatencyHandle(n, k, m, hidden.dtype, h, topk_weights, slot_rows)
        if ep == 1:
            handle.payload = payload
            return handle
        handle.payload = torch.empty_like(payload)
        handle.works = [self.transport.all_to_all_equal(handle.payload, payload)]
        return handle

    def dispatch_b(self, handle: LowLatencyHandle) -> MaskedExpertRows:
        """Wait for the dispatch and pack each expert's rows: ``x`` [E_local, ep * M, H], ``counts`` [E_local] int32."""
        for w in handle.works:
            w.wait()
        handle.works = []
        ep, el, m, h, dtype = self.ep_size, self.num_local_experts, handle.capacity, handle.hidden_size, handle.dtype
        payload, handle.payload = handle.payload, None
        row_bytes = el * m * h * dtype.itemsize
        hb = _aligned(row_bytes)
        rows = payload[:, :row_bytes].view(dtype).view(ep, el, m, h)             # [src, E_local, M, H]
        per_src = payload[:, hb:].view(torch.int64).view(ep, el).t()             # [E_local, src]
        incl = per_src.cumsum(1)
        excl = incl - per_src
        c = ep * m
        pos = torch.arange(c, device=payload.device)
        src = (pos.view(1, 1, c) >= incl.unsqueeze(-1)).sum(1).clamp_(max=ep - 1)  # [E_local, C] source rank
        slot = (pos.view(1, c) - excl.gather(1, src)).clamp_(0, m - 1)             # [E_local, C] its slot
        expert = torch.arange(el, device=payload.device).view(el, 1).expand(el, c)
        x = rows[src, expert, slot]                                                 # [E_local, C, H]
        unpack = (excl.t().unsqueeze(-1) + torch.arange(m, device=payload.device)).clamp_(max=c - 1)  # [ep, EL, M]
        handle.unpack_index = unpack
        return MaskedExpertRows(x, incl[:, -1].to(torch.int32))

    def combine_a(self, handle: LowLatencyHandle, expert_out: torch.Tensor) -> None:
        """Start sending expert outputs ``expert_out`` [E_local, ep * M, H] (packed, as dispatched) back."""
        ep, el, m = self.ep_size, self.num_local_experts, handle.capacity
        h = expert_out.shape[-1]
        expert = torch.arange(el, device=expert_out.device).view(1, el, 1).expand(ep, el, m)
        back = expert_out[expert, handle.unpack_index].reshape(ep, el * m * h)     # slot layout per source rank
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
