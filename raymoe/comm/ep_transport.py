"""The expert-parallel group's all-to-all transport: shared memory between CPU ranks of one node, else
``torch.distributed`` (gloo on CPU, NCCL on GPU).

Both MoE dispatch modes go through :class:`EpTransport` (``raymoe.comm.all_to_all`` normal mode,
``raymoe.comm.low_latency`` low-latency mode). Which path a call takes depends only on numbers every rank of the
group knows alike (the message size of an equal split; the largest pair of a variable split, known to all ranks
from :meth:`EpTransport.exchange_counts`), so all ranks take the same path for the same call and the collective
sequence stays matched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from raymoe.comm.groups import ParallelGroups


class EpTransport:
    """All-to-all over ``groups.ep_group``, through ``groups.ep_shm`` (:class:`~raymoe.platform.cpu.shm.ShmAllToAll`)
    when the ranks have one and the message fits its slots.

    Attributes:
        shm_calls, dist_calls: calls that went through shared memory / ``torch.distributed`` (diagnostics).
    """

    def __init__(self, groups: ParallelGroups):
        self.group = groups.ep_group
        self.shm = groups.ep_shm
        self.ep_size = groups.ep_size
        self.ep_rank = groups.ep_rank
        self.shm_calls = 0
        self.dist_calls = 0

    def all_to_all_equal(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Start an equal-split all-to-all of ``inp`` into ``out`` (same shapes, first dim divisible into
        ``ep_size`` chunks); returns a work whose ``wait()`` completes it."""
        chunk_bytes = inp.numel() * inp.element_size() // self.ep_size
        if self.shm is not None and self.shm.fits(chunk_bytes):
            self.shm_calls += 1
            return self.shm.all_to_all_single(out, inp)
        self.dist_calls += 1
        return dist.all_to_all_single(out, inp, group=self.group, async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        """Start an all-gather of ``inp`` into ``out`` (``ep_size`` times its elements; chunk ``s`` from rank
        ``s``); returns a work whose ``wait()`` completes it. The path depends on the message size only."""
        if self.shm is not None and self.shm.fits(inp.numel() * inp.element_size()):
            self.shm_calls += 1
            return self.shm.all_gather(out, inp)
        self.dist_calls += 1
        if inp.device.type == "cuda":
            return dist.all_gather_into_tensor(out.view(-1), inp.view(-1), group=self.group, async_op=True)
        return dist.all_to_all_single(out.view(-1), inp.view(-1).repeat(self.ep_size), group=self.group,
                                      async_op=True)

    def exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int], int]:
        """Exchange per-peer row counts (blocking; syncs with the host).

        Args:
            send_counts: [ep] int64 rows this rank sends to each peer.
        Returns:
            (send_counts, recv_counts, max_pair_rows): host lists, and the largest count any rank sends any peer
            (the same number on every rank; through shared memory only, else the largest of this rank's own
            sends and receives, which gloo paths never need to agree on).
        """
        p = self.ep_size
        if self.shm is not None:  # p * p int64: far below any slot
            matrix = torch.empty(p * p, dtype=torch.int64)
            self.shm.all_to_all_single(matrix, send_counts.to("cpu", torch.int64).repeat(p)).wait()
            self.shm_calls += 1
            rows = matrix.view(p, p).tolist()  # row s: what rank s sends to each peer
            return rows[self.ep_rank], [r[self.ep_rank] for r in rows], max(max(r) for r in rows)
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts, group=self.group)
        self.dist_calls += 1
        send_l, recv_l = send_counts.tolist(), recv.tolist()
        return send_l, recv_l, max(send_l + recv_l)

    def all_to_all_rows(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                        max_pair_rows: int) -> Any:
        """Start a variable-split all-to-all of rows (dim 0). ``max_pair_rows`` from :meth:`exchange_counts`
        decides the path for all ranks alike; returns a work whose ``wait()`` completes it."""
        row_bytes = math.prod(inp.shape[1:]) * inp.element_size()
        if self.shm is not None and self.shm.fits(max_pair_rows * row_bytes):
            self.shm_calls += 1
            return self.shm.all_to_all_single(out, inp.contiguous(), out_splits, in_splits)
        self.dist_calls += 1
        return dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group, async_op=True)
