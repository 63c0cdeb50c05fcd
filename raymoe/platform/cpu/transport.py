"""The CPU platform's expert-parallel transport: the shared-memory exchange between ranks of one node
(``raymoe.platform.cpu.shm``) for messages that fit its slots, ``torch.distributed`` (gloo) for the rest.

gloo moves even a few kilobytes through the TCP loopback and needs the kernel to wake the peer for each exchange:
about 190 us per small exchange between two processes on the 2-core CI machine, about 2 ms per MoE layer. The
shared mapping takes about 25 us per round trip.

Which path a call takes depends only on numbers every rank of the group knows alike (the message size of an equal
split; the largest pair of a variable split, which :meth:`ShmEpTransport.exchange_counts` gives every rank), so all
ranks take the same path for the same call and the collective sequence stays matched.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raymoe.comm.ep_transport import DistEpTransport
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.transport import Work
from raymoe.config.parallel import CPU_COMM_MODES
from raymoe.platform.cpu.shm import ShmAllToAll
from raymoe.platform.cpu.shm_layout import shm_supported

logger = logging.getLogger(__name__)


class ShmEpTransport(DistEpTransport):
    """:class:`~raymoe.comm.transport.EpTransport` through ``shm`` where a message fits its slots, else gloo.

    Attributes:
        shm: the group's shared-memory communicator. shm_calls, dist_calls: exchanges per path (diagnostics).
    """

    def __init__(self, groups: ParallelGroups, shm: ShmAllToAll):
        super().__init__(groups)
        self.shm = shm
        self.shm_calls = 0

    def abort(self) -> None:
        """Abort the shared mapping (``ShmAllToAll.abort``: every rank's waits return and raise)."""
        self.shm.abort()

    def all_to_all_equal(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        if self.shm.fits(inp.numel() * inp.element_size() // self.ep_size):
            self.shm_calls += 1
            return self.shm.all_to_all_single(out, inp)
        return super().all_to_all_equal(out, inp)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        if self.shm.fits(inp.numel() * inp.element_size()):
            self.shm_calls += 1
            return self.shm.all_gather(out, inp)
        return super().all_gather(out, inp)

    def exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int], int]:
        """As :meth:`~raymoe.comm.transport.EpTransport.exchange_counts`, through shared memory (``p * p`` int64
        fit any slot): every rank sees every rank's counts, so ``max_pair_rows`` is the largest count any rank sends
        any peer, the same number on every rank."""
        p = self.ep_size
        matrix = torch.empty(p * p, dtype=torch.int64)
        self.shm.all_to_all_single(matrix, send_counts.to("cpu", torch.int64).repeat(p)).wait()
        self.shm_calls += 1
        rows = matrix.view(p, p).tolist()  # row s: what rank s sends to each peer
        return rows[self.ep_rank], [r[self.ep_rank] for r in rows], max(max(r) for r in rows)

    def all_to_all_rows(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                        max_pair_rows: int) -> Work:
        row_bytes = math.prod(inp.shape[1:]) * inp.element_size()
        if self.shm.fits(max_pair_rows * row_bytes):
            self.shm_calls += 1
            return self.shm.all_to_all_single(out, inp.contiguous(), out_splits, in_splits)
        return super().all_to_all_rows(out, inp, out_splits, in_splits, max_pair_rows)


@dataclass(frozen=True)
class _RankFacts:
    """What each rank tells the group before it maps shared memory: its machine and whether it can map."""

    node: str
    shm_ok: bool


def _node_key() -> str:
    """Identifies this machine's kernel instance: host name plus boot id (two containers may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def create_ep_transport(groups: ParallelGroups, cpu_comm: str, timeout_s: float) -> ShmEpTransport | None:
    """The EP group's shared-memory transport, or None where gloo carries everything (``cpu_comm="gloo"``, one EP
    rank, or ``auto`` where the mapping cannot run). Collective over ``groups.ep_group``: every rank sees the same
    gathered facts, so all ranks decide alike.

    Args:
        groups: the rank's groups (``ep_group`` set when ``ep_size > 1``).
        cpu_comm: ``"auto"`` (shared memory when every EP rank is on this node and can map it), ``"shm"`` (or an
            error) or ``"gloo"``.
        timeout_s: how long a shared-memory wait lasts before it raises, seconds.
    Raises:
        ValueError: an unknown ``cpu_comm``, or ``"shm"`` where the ranks span nodes or lack ``/dev/shm``.
        OSError: ``"shm"`` and ``/dev/shm`` cannot hold the mapping.
    """
    if cpu_comm not in CPU_COMM_MODES:
        raise ValueError(f"cpu_comm must be one of {CPU_COMM_MODES}, got {cpu_comm!r}")
    if groups.ep_size < 2 or cpu_comm == "gloo":
        return None
    facts: list = [None] * groups.ep_size
    dist.all_gather_object(facts, _RankFacts(_node_key(), shm_supported()), group=groups.ep_group)
    one_node = len({f.node for f in facts}) == 1
    if not (one_node and all(f.shm_ok for f in facts)):
        why = "the EP ranks span several nodes" if not one_node else "a rank has no usable /dev/shm (or not x86-64)"
        if cpu_comm == "shm":
            raise ValueError(f"cpu_comm='shm': {why}")
        logger.info("EP all-to-all over gloo: %s", why)
        return None
    try:
        shm = ShmAllToAll.create(groups.ep_group, timeout_s=timeout_s)
    except OSError as e:  # raised on every rank alike (rank 0 broadcasts the reservation's outcome)
        if cpu_comm == "shm":
            raise
        logger.warning("EP all-to-all over gloo: %s", e)
        return None
    return ShmEpTransport(groups, shm)
