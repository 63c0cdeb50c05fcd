"""The typed interface of an expert-parallel group's transport (:class:`EpTransport`), which every MoE exchange
goes through, and of a started exchange (:class:`Work`).

Implementations: ``raymoe.comm.ep_transport.DistEpTransport`` (``torch.distributed``: gloo on CPU, NCCL on GPU)
and the CPU platform's shared-memory exchange between ranks of one node (``raymoe.platform.cpu.transport``).
Every call is a collective: all ranks of the group make the same calls in the same order.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Work(Protocol):
    """A started exchange; :meth:`wait` completes it (the output tensor is then valid)."""

    def wait(self) -> Any: ...


@runtime_checkable
class EpTransport(Protocol):
    """All-to-all exchanges of one expert-parallel group (``ep_size`` ranks, this one ``ep_rank``).

    Attributes:
        ep_size, ep_rank: the group's size and this rank's index in it.
    """

    ep_size: int
    ep_rank: int

    def all_to_all_equal(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Start an equal-split all-to-all: chunk ``d`` of ``inp`` (dim 0 cut in ``ep_size`` equal chunks) goes
        to rank ``d``, chunk ``s`` of ``out`` (same shape) comes from rank ``s``."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """Start an all-gather: ``out`` holds ``ep_size`` times ``inp``'s elements, chunk ``s`` from rank ``s``."""

    def exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int], int]:
        """Exchange per-peer row counts (blocking; a host sync).

        Args:
            send_counts: [ep] int64 rows this rank sends to each peer.
        Returns:
            ``(send_counts, recv_counts, max_pair_rows)``: host lists, and a bound on the rows of any one pair
            that :meth:`all_to_all_rows` takes to pick its path (every rank of the group gets the same number
            where the implementation needs them to agree).
        """

    def all_to_all_rows(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                        max_pair_rows: int) -> Work:
        """Start a variable-split all-to-all of rows (dim 0): ``in_splits[d]`` rows to rank ``d``,
        ``out_splits[s]`` rows from rank ``s``; ``max_pair_rows`` from :meth:`exchange_counts`."""

    def abort(self) -> None:
        """End every wait of this transport on its peers, from another thread (a peer died: an elastic shrink,
        ``RankWorker.abort_collectives``); later exchanges raise. The transport is not used again."""
