"""The shared mapping of the CPU ranks' all-to-all (``raymoe.platform.cpu.shm``): its geometry, how the ranks of a
group create and map it, and the byte ranges a collective's chunks take.

Layout of the mapping (``P`` ranks, ``K`` slots per ordered pair, ``C`` bytes per slot):

* control: ``ready[src, dst]`` (the last call ``src`` posted to ``dst``) and ``done[src, dst, slot]`` (the last
  call ``dst`` consumed from that slot) int64 sequence numbers, each on its own 64-byte line;
* data: one mailbox ring per ordered pair ``(src, dst)``, ``K`` slots of ``C`` bytes.

The file lives in ``/dev/shm`` only until every rank has mapped it (then rank 0 unlinks it), so a crashed rank
leaves nothing behind. Its space is reserved with ``posix_fallocate`` up front: a full ``/dev/shm`` fails the
setup with OSError instead of a SIGBUS mid-step.
"""

from __future__ import annotations

import mmap
import os
import platform
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
DEFAULT_BUDGET_BYTES = 128 << 20  # /dev/shm one EP group's mapping may take by default (slots only)
LINE = 8  # int64 per control entry: one 64-byte cache line each (no false sharing between writers)
NATIVE_SPIN_NS = 30000
"""How long a native wait spins before it sleeps on the futex, nanoseconds, when the group's ranks fit this
machine's cores: two expert-parallel ranks post each MoE exchange within tens of microseconds of each other, and a
30 us spin catches most posts without the sleep and the peer's wake-up call. Served dp=2 ep=2 at c=16 on the
2-core benchmark machine: 2-11 % more tokens/s than a 5 us spin in five alternating pairs, 100 us no better than
30."""

OVERSUBSCRIBED_SPIN_NS = 5000
"""The spin when the group has more ranks than the machine has cores (about the Python path's 64 flag reads):
a peer that cannot run meanwhile never posts during a spin, so a long one only takes its CPU."""


def default_spin_ns(ranks: int) -> int:
    """:data:`NATIVE_SPIN_NS` when ``ranks`` processes fit the cores this process may run on, else
    :data:`OVERSUBSCRIBED_SPIN_NS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return NATIVE_SPIN_NS if ranks <= cores else OVERSUBSCRIBED_SPIN_NS


def shm_supported() -> bool:
    """Whether this machine can run :class:`ShmAllToAll`: x86-64 (store order) and a writable ``/dev/shm``."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.access(SHM_DIR, os.W_OK)


@dataclass(frozen=True)
class ShmLayout:
    """Geometry of the mapping: ``size`` ranks P, ``num_slots`` K per ordered pair, ``slot_bytes`` C each.

    Raises:
        ValueError: P < 2, K < 2 or C < 64.
    """

    size: int
    num_slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.size < 2 or self.num_slots < 2 or self.slot_bytes < 64:
            raise ValueError(f"need size >= 2, num_slots >= 2 and slot_bytes >= 64, got {self}")

    @property
    def control_entries(self) -> int:
        """int64 control lines: ``ready`` [P, P] then ``done`` [P, P, K]."""
        return self.size * self.size * (1 + self.num_slots)

    @property
    def control_bytes(self) -> int:
        raw = self.control_entries * LINE * 8
        return (raw + 4095) // 4096 * 4096

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole mapping: control page(s) plus ``P * P * K * C`` of mailboxes."""
        return self.control_bytes + self.size * self.size * self.num_slots * self.slot_bytes

    def slot_offset(self, src: int, dst: int, slot: int) -> int:
        """Byte offset of slot ``slot`` of the mailbox ``src -> dst``."""
        return self.control_bytes + ((src * self.size + dst) * self.num_slots + slot) * self.slot_bytes


def map_shared(group: dist.ProcessGroup, layout: ShmLayout) -> mmap.mmap:
    """Create the mapping's file on the group's rank 0, reserve its space, map it on every rank, then unlink it
    (collective over ``group``).

    Raises:
        OSError: ``/dev/shm`` cannot hold ``layout.total_bytes`` (raised on every rank alike: rank 0 broadcasts
            the reservation's outcome).
    """
    rank = dist.get_rank(group)
    path = [os.path.join(SHM_DIR, f"raymoe-a2a-{uuid.uuid4().hex}") if rank == 0 else None]
    err = [None]
    if rank == 0:
        try:
            fd = os.open(path[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, layout.total_bytes)
            finally:
                os.close(fd)
        except OSError as e:
            err[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
    dist.broadcast_object_list(err, src=dist.get_global_rank(group, 0), group=group)
    if err[0] is not None:
        raise OSError(f"shared-memory all-to-all: cannot reserve {layout.total_bytes} bytes in {SHM_DIR}: {err[0]}")
    fd = os.open(path[0], os.O_RDWR)
    try:
        buf = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(path[0])
    return buf


def check_tensors(out: torch.Tensor, inp: torch.Tensor) -> None:
    """Raise ValueError unless ``out`` and ``inp`` are contiguous CPU tensors of one dtype."""
    if not (out.is_contiguous() and inp.is_contiguous()) or out.device.type != "cpu" or inp.dtype != out.dtype:
        raise ValueError("shared-memory collectives need contiguous CPU tensors of one dtype")


def chunks(t: torch.Tensor, splits: list[int] | None, p: int) -> list[tuple[int, int]]:
    """(byte offset, byte count) of each of the ``p`` chunks of ``t`` along dim 0."""
    total = t.numel() * t.element_size()
    if splits is None:
        if total % p:
            raise ValueError(f"{total} bytes do not split into {p} equal chunks")
        n = total // p
        return [(i * n, n) for i in range(p)]
    rows = t.shape[0] if t.dim() else 1
    if len(splits) != p or sum(splits) != rows:
        raise ValueError(f"splits {splits} do not cover the {rows} rows for {p} ranks")
    row = total // rows if rows else 0
    out, off = [], 0
    for s in splits:
        out.append((off, s * row))
        off += s * row
    return out
