"""The expert-parallel group's ``torch.distributed`` transport (gloo on CPU, NCCL on GPU), an implementation of
:class:`~raymoe.comm.transport.EpTransport`.

Both MoE dispatch modes (``raymoe.comm.all_to_all`` normal mode, ``raymoe.comm.low_latency`` low-latency mode) and
the vocabulary-split LM head call an :class:`EpTransport`. A platform may hand its ranks a faster one (the CPU
platform's shared-memory exchange between ranks of one node, ``raymoe.platform.cpu.transport``); the rank's
``ParallelGroups.ep_transport`` holds it, and :func:`ep_transport_of` falls back to :class:`DistEpTransport`.

Every call is a collective: all ranks of the group make the same calls in the same order. An implementation that
picks between paths (shared memory or ``torch.distributed``) must decide from numbers every rank knows alike (the
message size of an equal split, the largest pair of a variable split as :meth:`EpTransport.exchange_counts`
returns it), so the collective sequence stays matched on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raymoe.comm.groups import ParallelGroups
from raymoe.comm.transport import EpTransport, Work


class DistEpTransport:
    """:class:`EpTransport` over ``groups.ep_group`` with ``torch.distributed`` collectives (``async_op=True``: on
    NCCL a ``wait()`` only orders the current stream, so the ``_a`` halves of a dispatch never block the host).

    Attributes:
        dist_calls: exchanges started (diagnostics).
    Raises:
        ValueError: ``groups.ep_size`` is 1 (there is nothing to exchange).
    """

    def __init__(self, groups: ParallelGroups):
        if groups.ep_size < 2:
            raise ValueError("an EP transport needs ep_size >= 2")
        self.group = groups.ep_group
        self.ep_size = groups.ep_size
        self.ep_rank = groups.ep_rank
        self.dist_calls = 0

    def abort(self) -> None:
        """Nothing to do: a gloo collective fails once a dead peer's connection closes, and NCCL communicators are
        aborted for the whole process (``RankWorker.abort_collectives``)."""

    def all_to_all_equal(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self.dist_calls += 1
        return dist.all_to_all_single(out, inp, group=self.group, async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        self.dist_calls += 1
        if inp.device.type == "cuda":
            return dist.all_gather_into_tensor(out.view(-1), inp.view(-1), group=self.group, async_op=True)
        # gloo has no all_gather_into_tensor: the same bytes as an equal all-to-all of repeated chunks
        return dist.all_to_all_single(out.view(-1), inp.view(-1).repeat(self.ep_size), group=self.group,
                                      async_op=True)

    def exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int], int]:
        """As :meth:`EpTransport.exchange_counts`; ``max_pair_rows`` is the largest of this rank's own sends and
        receives (this transport has one path, so ranks need not agree on it)."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        self.dist_calls += 1
        send_l, recv_l = send_counts.tolist(), recv.tolist()
        return send_l, recv_l, max(send_l + recv_l)

    def all_to_all_rows(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                        max_pair_rows: int) -> Work:
        self.dist_calls += 1
        return dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group, async_op=True)


def ep_transport_of(groups: ParallelGroups) -> EpTransport | None:
    """The transport a rank's MoE exchanges use: ``groups.ep_transport`` (the platform's, made when the groups
    were created), else :class:`DistEpTransport` over ``groups.ep_group``; None with one EP rank."""
    if groups.ep_size < 2:
        return None
    return groups.ep_transport if groups.ep_transport is not None else DistEpTransport(groups)
