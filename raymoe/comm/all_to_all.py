"""MoE token dispatch/combine over the expert-parallel group, normal mode (data-dependent shapes).

Each (token, k) routing pair is sent to the rank that owns expert ``topk_ids[token, k]`` (experts are
assigned in contiguous blocks: rank r owns experts ``[r * E_local, (r + 1) * E_local)``), processed there,
and sent back. Both directions are split into an ``_a`` half that starts the transfer (``async_op=True``)
and a ``_b`` half that waits for it, so overlap schedules (two-batch overlap, DESIGN section 4) can run
other work in between. With ``ep_size == 1`` nothing is sent; the same records flow locally.

The combine can also be sent in ``num_parts`` parts (single-batch overlap, ``raymoe.overlap.sbo``): part ``p``
holds, of every peer's chunk of received rows, the slice ``[c * p // n, c * (p + 1) // n)`` (``c`` the chunk's
row count, :func:`part_row_index`), so both sides know each part's counts without another exchange.

The combine applies the top-k weights and returns one row per token. Pairs whose id is ``NO_EXPERT`` (-1: a
decode graph's padding rows) are sent to no rank; with ``ep_size == 1`` they reach the experts, which multiply
them by nothing (:class:`~raymoe.comm.expert_input.ExpertRows`). The low-latency (fixed-shape) mode is
``raymoe.comm.low_latency``; ``raymoe.comm.dispatcher`` picks between them per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raymoe.comm.ep_transport import ep_transport_of
from raymoe.comm.expert_input import ExpertRows
from raymoe.comm.groups import ParallelGroups


@dataclass
class DispatchHandle:
    """State of a dispatch between ``dispatch_a`` and ``combine_b`` (owned by one MoE layer call).

    ``topk_weights`` [N, k] are applied by the combine. ``order`` [P] int64 holds the sent pairs (of the N * k,
    those with an expert) sorted by destination rank; ``send_counts`` /
    ``recv_counts`` are pairs per peer rank; ``recv_hidden`` [R, H] and ``recv_expert_ids`` [R] (local expert
    ids) are filled when the transfer completes; ``works`` are pending async collective handles;
    ``combine_parts`` are (part, num_parts, receive buffer) of a combine sent in parts; ``max_pair_rows`` is the
    largest count any rank sends any peer in this dispatch (picks the transport path, the same on every rank).
    """

    num_tokens: int
    top_k: int
    topk_weights: torch.Tensor
    order: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    recv_hidden: torch.Tensor
    recv_expert_ids: torch.Tensor
    works: list[Any]
    combined: torch.Tensor | None = None
    combine_parts: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    max_pair_rows: int = 0


class TorchAllToAll:
    """Dispatch/combine with ``all_to_all_single`` exchanges over the EP group's transport
    (:class:`~raymoe.comm.transport.EpTransport`: the platform's, such as shared memory between CPU ranks of one
    node, else ``torch.distributed``).

    Args:
        groups: the rank's process groups; its EP transport is used (never the world group).
        num_experts: total routed experts E (divisible by ``ep_size``).
    """

    def __init__(self, groups: ParallelGroups, num_experts: int):
        self.groups = groups
        self.ep_size = groups.ep_size
        self.num_local_experts = num_experts // groups.ep_size
        self.local_expert_start = groups.ep_rank * self.num_local_experts
        self.transport = ep_transport_of(groups)

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DispatchHandle:
        """Start sending each routing pair's hidden row to its expert's owner (syncs once for the row counts).

        Args:
            hidden: [N, H] tokens of this rank.
            topk_ids: [N, k] int64 global expert ids, or ``NO_EXPERT`` for a pair sent nowhere. topk_weights:
                [N, k] hidden dtype, used by the combine.
        Returns:
            a handle whose ``recv_*`` tensors are valid after :meth:`dispatch_b`.
        """
        n, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        if self.ep_size == 1:
            order = torch.arange(n * k, device=hidden.device)
            recv = hidden.repeat_interleave(k, dim=0) if k > 1 else hidden
            return DispatchHandle(n, k, topk_weights, order, [n * k], [n * k], recv, flat_ids, [])
        # destination rank of each pair; NO_EXPERT -> ep_size, sorted after every rank's pairs and never sent
        dest = torch.div(flat_ids, self.num_local_experts, rounding_mode="floor").remainder_(self.ep_size + 1)
        order = torch.argsort(dest, stable=True)
        send_counts, recv_counts, max_pair = self.transport.exchange_counts(
            torch.bincount(dest, minlength=self.ep_size + 1)[:self.ep_size])
        if sum(send_counts) < n * k:
            order = order[:sum(send_counts)]  # NO_EXPERT pairs stay home
        token_of_pair = torch.div(order, k, rounding_mode="floor")
        send_hidden = hidden[token_of_pair]
        send_ids = flat_ids[order]
        total = sum(recv_counts)
        recv_hidden = hidden.new_empty((total, hidden.shape[1]))
        recv_ids = flat_ids.new_empty((total,))
        w1 = self.transport.all_to_all_rows(recv_hidden, send_hidden, recv_counts, send_counts, max_pair)
        w2 = self.transport.all_to_all_rows(recv_ids, send_ids, recv_counts, send_counts, max_pair)
        return DispatchHandle(n, k, topk_weights, order, send_counts, recv_counts, recv_hidden, recv_ids, [w1, w2],
                              max_pair_rows=max_pair)

    def dispatch_b(self, handle: DispatchHandle) -> ExpertRows:
        """Wait for the dispatch; returns the received rows ``x`` [R, H] and their local expert ids [R] int64."""
        for w in handle.works:
            w.wait()
        handle.works = []
        return ExpertRows(handle.recv_hidden, handle.recv_expert_ids - self.local_expert_start)

    def combine_a(self, handle: DispatchHandle, expert_out: torch.Tensor, part: int = 0, num_parts: int = 1) -> None:
        """Start sending expert outputs ``expert_out`` [R, H] back to the ranks the pairs came from.

        With ``num_parts > 1``, ``expert_out`` holds only the rows of part ``part`` (in the order of
        :func:`part_row_index` over ``handle.recv_counts``); every part must be sent before :meth:`combine_b`.
        """
        if num_parts > 1:
            self._combine_part_a(handle, expert_out, part, num_parts)
            return
        if self.ep_size == 1:
            handle.combined = expert_out
            return
        back = expert_out.new_empty((sum(handle.send_counts), expert_out.shape[1]))
        w = self.transport.all_to_all_rows(back, expert_out, handle.send_counts, handle.recv_counts,
                                           handle.max_pair_rows)
        handle.combined = back
        handle.works = [w]

    def _combine_part_a(self, handle: DispatchHandle, rows: torch.Tensor, part: int, num_parts: int) -> None:
        if self.ep_size == 1:
            handle.combine_parts.append((part, num_parts, rows))
            return
        recv = rows.new_empty((sum(part_counts(handle.send_counts, part, num_parts)), rows.shape[1]))
        w = self.transport.all_to_all_rows(recv, rows, part_counts(handle.send_counts, part, num_parts),
                                           part_counts(handle.recv_counts, part, num_parts), handle.max_pair_rows)
        handle.combine_parts.append((part, num_parts, recv))
        handle.works.append(w)

    def combine_b(self, handle: DispatchHandle) -> torch.Tensor:
        """Wait for the combine; returns ``sum_j topk_weights[t, j] * expert_out(t, j)`` as [N, H]."""
        for w in handle.works:
            w.wait()
        handle.works = []
        if handle.combine_parts:
            first = handle.combine_parts[0][2]
            back = first.new_empty((sum(handle.send_counts), first.shape[1]))
            for part, num_parts, recv in handle.combine_parts:
                back[part_row_index(handle.send_counts, part, num_parts, back.device)] = recv
            handle.combined, handle.combine_parts = back, []
        out = handle.combined
        assert out is not None, "combine_a must run before combine_b"
        if self.ep_size > 1:
            num_pairs = handle.num_tokens * handle.top_k
            make = out.new_empty if out.shape[0] == num_pairs else out.new_zeros  # pairs sent nowhere add 0
            unsorted = make((num_pairs, out.shape[1]))
            unsorted[handle.order] = out
            out = unsorted
        pairs = out.view(handle.num_tokens, handle.top_k, out.shape[-1])  # num_tokens may be 0 (IDLE)
        return (pairs * handle.topk_weights.unsqueeze(-1)).sum(dim=1)


def part_counts(counts: list[int], part: int, num_parts: int) -> list[int]:
    """Rows of part ``part`` (of ``num_parts``) in each per-peer chunk of ``counts`` rows."""
    return [c * (part + 1) // num_parts - c * part // num_parts for c in counts]


def part_row_index(counts: list[int], part: int, num_parts: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Indices [sum(part_counts)] int64 of part ``part``'s rows in a buffer of per-peer chunks of ``counts`` rows."""
    pieces, start = [], 0
    for c in counts:
        pieces.append(torch.arange(start + c * part // num_parts, start + c * (part + 1) // num_parts, device=device))
        start += c
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64, device=device)
