"""Shared-memory all-to-all between the CPU ranks of one process group on one node.

gloo moves even a few kilobytes through the TCP loopback, and each exchange needs the kernel to wake the peer
process: about 2 ms per MoE layer between two ranks on two shared cores (measured, docs/performance.md). Ranks of
one node can instead exchange through one shared mapping, as the CPU communicators of vLLM and SGLang do for
all-reduce. This module does it for the MoE all-to-all (and the all-gather of the low-latency dispatch).

Layout of the mapping (``P`` ranks, ``K`` slots per ordered pair, ``C`` bytes per slot):

* control: ``ready[src, dst]`` (the last call ``src`` posted to ``dst``) and ``done[src, dst, slot]`` (the last
  call ``dst`` consumed from that slot) int64 sequence numbers, each on its own 64-byte line;
* data: one mailbox ring per ordered pair ``(src, dst)``, ``K`` slots of ``C`` bytes.

Every call is a collective: all ranks of the group make the same calls in the same order, so the ``n``-th call
has sequence number ``n`` on every rank. Posting call ``s`` copies the chunk for ``dst`` into slot ``s % K`` of
``(me, dst)`` (after ``dst`` has consumed call ``s - K`` from that slot) and then stores ``ready[me, dst] = s``;
waiting for it polls ``ready[src, me] >= s``, copies the slot out and stores ``done[src, me, s % K] = s``.
Posting returns at once, so the ``_a``/``_b`` halves of a dispatch or combine overlap other work (two-batch
overlap) without a progress thread. Calls may be waited on in any order (two TBO children interleave), but call
``s - K`` must have been waited on before call ``s`` is posted: every rank runs the same sequence, so each peer
then has consumed it too (or will, without waiting for this rank), and no post can block forever.

Ordering: the flag store follows the data copy in program order, and x86-64 (TSO) keeps stores in order as seen
by other cores, so a reader that sees the flag sees the data (glibc's ``memmove`` ends its non-temporal copies of
large blocks with an ``sfence``).

Copies are one ``memmove`` (``ctypes``) each between precomputed addresses, not tensor slices: a message is a
few kilobytes in a decode step, and three tensor calls per copy took longer than the copy (about 60 against 15
microseconds per two-rank all-gather post, docs/performance.md). :func:`shm_supported` is False elsewhere, and
``cpu_comm="auto"`` then keeps gloo.

Native path: where every rank of the group has raymoe's C kernel library (``raymoe.platform.cpu.kernels.build``; agreed when
the group maps, :meth:`ShmAllToAll.create`), an equal-chunk post or receive (all-gather, equal all-to-all: the
low-latency dispatch and combine) is one C call (``csrc/shm_exchange.c``), and every flag wait and store of the
group, variable splits included, uses that file's protocol: a writer makes the ``futex_wake`` system call only
when the flag's waiter has announced that it may sleep (a waiter word next to each flag). The Python protocol
below, used when any rank lacks the library, wakes on every store.

The file lives in ``/dev/shm`` only until every rank has mapped it (then rank 0 unlinks it), so a crashed rank
leaves nothing behind. Its space is reserved with ``posix_fallocate`` up front: a full ``/dev/shm`` fails the
setup with OSError instead of a SIGBUS mid-step.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from raymoe.platform.cpu.futex import flag_address, futex_wake, wait_flag_ge
from raymoe.platform.cpu.kernels import build

SHM_DIR = "/dev/shm"
DEFAULT_BUDGET_BYTES = 128 << 20  # /dev/shm one EP group's mapping may take by default (slots only)
_LINE = 8  # int64 per control entry: one 64-byte cache line each (no false sharing between writers)
NATIVE_SPIN_NS = 30000
"""How long a native wait spins before it sleeps on the futex, nanoseconds, when the group's ranks fit this
machine's cores: two expert-parallel ranks post each MoE exchange within tens of microseconds of each other, and a
30 us spin catches most posts without the sleep and the peer's wake-up call. Served dp=2 ep=2 at c=16 on the
2-core benchmark machine: 2-11 % more tokens/s than a 5 us spin in five alternating pairs, 100 us no better than 30
(docs/performance.md, sixteenth session)."""

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
        raw = self.control_entries * _LINE * 8
        return (raw + 4095) // 4096 * 4096

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole mapping: control page(s) plus ``P * P * K * C`` of mailboxes."""
        return self.control_bytes + self.size * self.size * self.num_slots * self.slot_bytes

    def slot_offset(self, src: int, dst: int, slot: int) -> int:
        """Byte offset of slot ``slot`` of the mailbox ``src -> dst``."""
        return self.control_bytes + ((src * self.size + dst) * self.num_slots + slot) * self.slot_bytes


class ShmWork:
    """A posted :meth:`ShmAllToAll` call; :meth:`wait` receives the peers' chunks (same role as gloo's Work)."""

    def __init__(self, comm: ShmAllToAll, seq: int, out: torch.Tensor, out_chunks: list[tuple[int, int]] | None,
                 chunk_bytes: int = 0):
        self._comm, self._seq, self._out, self._chunks, self._chunk_bytes = comm, seq, out, out_chunks, chunk_bytes
        self._done = False

    def wait(self) -> bool:
        """Block until every peer's chunk of this call has been copied into the output. Idempotent.

        Raises:
            TimeoutError: a peer did not post within the communicator's timeout.
        """
        if not self._done:
            if self._chunks is None:  # native equal-chunk call: chunk s of `_chunk_bytes` bytes from rank s
                self._comm._receive_native(self._seq, self._out, self._chunk_bytes)
            else:
                self._comm._receive(self._seq, self._out, self._chunks)
            self._done = True
        return True


class ShmAllToAll:
    """All-to-all over a shared mapping among the ``P`` ranks of ``group`` (all on this node; CPU tensors only).

    Build it with :meth:`create` (collective over ``group``); the mapping lives as long as the process. Messages
    are byte ranges of contiguous CPU tensors; a message larger than ``slot_bytes`` cannot go through (check
    :meth:`fits`; callers then use gloo, deciding from sizes every rank knows, so all ranks choose alike).

    Args:
        rank, layout: this rank's index in the group and the mapping's geometry.
        buf: the mapping (``mmap``), kept open for the communicator's life.
        timeout_s: how long :meth:`ShmWork.wait` and slot reuse wait for a peer, seconds.
        native: use the C exchange (module docstring). Every rank of the group must pass the same value
            (:meth:`create` agrees on it); True needs the kernel library (``raymoe.platform.cpu.kernels.build.load()``).
        spin_ns: how long a native wait spins before it sleeps, nanoseconds (None: :func:`default_spin_ns`).
    Raises:
        RuntimeError: ``native`` without the kernel library.
    """

    def __init__(self, rank: int, layout: ShmLayout, buf: mmap.mmap, timeout_s: float = 60.0,
                 native: bool = False, spin_ns: int | None = None):
        self.rank, self.layout, self.timeout_s = rank, layout, timeout_s
        self.spin_ns = default_spin_ns(layout.size) if spin_ns is None else spin_ns
        self._lib = build.load() if native else None
        if native and self._lib is None:
            raise RuntimeError("native shared-memory exchange needs raymoe's C kernel library, which is not loaded")
        self._buf = buf
        self._bytes = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping's buffer exported (and alive)
        self._base = self._bytes.data_ptr()
        p = layout.size
        ctl = np.frombuffer(buf, dtype=np.int64, count=layout.control_entries * _LINE).reshape(-1, _LINE)[:, 0]
        self._ready = ctl[:p * p].reshape(p, p)
        self._doneflag = ctl[p * p:].reshape(p, p, layout.num_slots)
        self._seq = 0
        self._pending: set[int] = set()  # calls this rank posted and has not waited on

    @property
    def native(self) -> bool:
        """Whether this communicator runs the C exchange (module docstring)."""
        return self._lib is not None

    @classmethod
    def create(cls, group, slot_bytes: int | None = None, num_slots: int = 8,
               timeout_s: float = 60.0, native: bool | None = None) -> ShmAllToAll:
        """Create the mapping on the group's rank 0, map it on every rank, then unlink it (collective).

        Defaults: 8 slots per pair, as two-batch overlap over a DeepSeek layer keeps up to 5 calls in flight (a
        normal-mode dispatch is three calls: counts, rows, ids). ``slot_bytes`` None shares
        :data:`DEFAULT_BUDGET_BYTES` of ``/dev/shm`` among the ``P * P * num_slots`` slots, within [256 KiB, 8 MiB]
        per slot (4 MiB at P = 2, 1 MiB at P = 4); a larger message goes through gloo. ``native`` None or True
        runs the C exchange when every rank has the kernel library (one all-reduce over ``group`` agrees on it;
        check :attr:`native`), False never does.

        Raises:
            OSError: ``/dev/shm`` cannot hold ``layout.total_bytes`` (raised on every rank alike).
        """
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if slot_bytes is None:
            slot_bytes = min(max(DEFAULT_BUDGET_BYTES // (size * size * num_slots), 256 << 10), 8 << 20)
        layout = ShmLayout(size, num_slots, slot_bytes)
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
            raise OSError(f"shared-memory all-to-all: cannot reserve {layout.total_bytes} bytes in {SHM_DIR}: "
                          f"{err[0]}")
        fd = os.open(path[0], os.O_RDWR)
        try:
            buf = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path[0])
        have = torch.tensor([int(native is not False and build.load() is not None)])
        dist.all_reduce(have, op=dist.ReduceOp.MIN, group=group)
        return cls(rank, layout, buf, timeout_s, native=bool(have.item()))

    @property
    def size(self) -> int:
        return self.layout.size

    def fits(self, nbytes: int) -> bool:
        """Whether one message (one rank's chunk for one peer) of ``nbytes`` fits a slot."""
        return nbytes <= self.layout.slot_bytes

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                          in_splits: list[int] | None = None) -> ShmWork:
        """Post a ``torch.distributed.all_to_all_single``: chunk ``d`` of ``inp`` goes to rank ``d``, chunk ``s``
        of ``out`` comes from rank ``s``. Splits are rows of dim 0 (None: equal chunks). Returns at once.

        Args:
            out, inp: contiguous CPU tensors of one dtype whose rows have the same size.
        Raises:
            ValueError: non-contiguous or non-CPU tensors, splits that do not add up, or a chunk over a slot.
            RuntimeError: call ``s - num_slots`` is still not waited on (the ring would need its slot).
        """
        p = self.size
        _check_tensors(out, inp)
        if self._lib is not None and in_splits is None and out_splits is None:
            total = inp.numel() * inp.element_size()
            if total % p or out.numel() * out.element_size() != total:
                raise ValueError(f"{total} bytes do not split into {p} equal chunks of the output's size")
            return self._post_native(out, inp, total // p, total // p)
        return self._post(out, inp, _chunks(inp, in_splits, p), _chunks(out, out_splits, p))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> ShmWork:
        """Post an all-gather: all of ``inp`` goes to every rank, chunk ``s`` of ``out`` (equal chunks of dim 0)
        comes from rank ``s``. Returns at once; a collective like :meth:`all_to_all_single` (same ring).

        Args:
            out: contiguous CPU tensor, ``P`` times ``inp``'s bytes. inp: contiguous CPU tensor of ``out``'s dtype.
        Raises:
            ValueError: as :meth:`all_to_all_single`, or ``out`` not ``P`` times the size of ``inp``.
        """
        p = self.size
        _check_tensors(out, inp)
        if out.numel() != p * inp.numel():
            raise ValueError(f"all-gather output of {out.numel()} elements is not {p} x {inp.numel()}")
        if self._lib is not None:
            return self._post_native(out, inp, 0, inp.numel() * inp.element_size())
        return self._post(out, inp, [(0, inp.numel() * inp.element_size())] * p, _chunks(out, None, p))

    def _next_seq(self) -> int:
        """Number the next call and record it in flight. Raises RuntimeError: the ring's slot is still held."""
        seq, k = self._seq + 1, self.layout.num_slots
        if self._pending and min(self._pending) <= seq - k:
            raise RuntimeError(f"shared-memory all-to-all call {min(self._pending)} is posted and not waited on, "
                               f"and call {seq} needs its slot (at most {k} calls in flight)")
        self._seq = seq
        self._pending.add(seq)
        return seq

    def _post_native(self, out: torch.Tensor, inp: torch.Tensor, stride: int, nbytes: int) -> ShmWork:
        """One C call posts an equal-chunk call: peer ``d`` gets ``nbytes`` from byte ``d * stride`` of ``inp``
        (stride 0: an all-gather); this rank's own chunk lands in ``out`` at ``me * nbytes``."""
        if nbytes > self.layout.slot_bytes:
            raise ValueError(f"a chunk exceeds the shared-memory slot of {self.layout.slot_bytes} bytes")
        seq, lay = self._next_seq(), self.layout
        rc = self._lib.raymoe_shm_post_equal(self._base, lay.control_bytes, lay.size, lay.num_slots,
                                             lay.slot_bytes, self.rank, seq, inp.data_ptr(), stride, nbytes,
                                             out.data_ptr(), self.timeout_s, self.spin_ns)
        if rc:
            self._timed_out(-rc - 1, "free its slot", seq - lay.num_slots)
        return ShmWork(self, seq, out, None, nbytes)

    def _receive_native(self, seq: int, out: torch.Tensor, nbytes: int) -> None:
        lay = self.layout
        rc = self._lib.raymoe_shm_receive_equal(self._base, lay.control_bytes, lay.size, lay.num_slots,
                                                lay.slot_bytes, self.rank, seq, out.data_ptr(), nbytes,
                                                self.timeout_s, self.spin_ns)
        if rc:
            self._timed_out(-rc - 1, "post", seq)
        self._pending.discard(seq)

    def _timed_out(self, peer: int, what: str, target: int) -> None:
        raise TimeoutError(f"shared-memory all-to-all: rank {peer} did not {what} for call {target} within "
                           f"{self.timeout_s:.1f} s")

    def _post(self, out: torch.Tensor, inp: torch.Tensor, in_chunks: list[tuple[int, int]],
              out_chunks: list[tuple[int, int]]) -> ShmWork:
        """Copy chunk ``in_chunks[d]`` of ``inp`` into this call's slot for each peer ``d`` (and our own chunk into
        ``out``), then raise the peers' ready flags."""
        p = self.size
        if max(n for _, n in in_chunks + out_chunks) > self.layout.slot_bytes:
            raise ValueError(f"a chunk exceeds the shared-memory slot of {self.layout.slot_bytes} bytes")
        seq, me, k = self._next_seq(), self.rank, self.layout.num_slots
        src, dst_ptr = inp.data_ptr(), out.data_ptr()
        for step in range(1, p):
            dst = (me + step) % p
            self._wait_flag(self._doneflag[me, dst], seq % k, seq - k, dst, "free its slot")
            off, n = in_chunks[dst]
            ctypes.memmove(self._base + self.layout.slot_offset(me, dst, seq % k), src + off, n)
            self._store_wake(self._ready[me], dst, seq)
        (o_off, o_n), (i_off, _) = out_chunks[me], in_chunks[me]
        ctypes.memmove(dst_ptr + o_off, src + i_off, o_n)
        return ShmWork(self, seq, out, out_chunks)

    def _receive(self, seq: int, out: torch.Tensor, out_chunks: list[tuple[int, int]]) -> None:
        p, me, k = self.size, self.rank, self.layout.num_slots
        dst_ptr = out.data_ptr()
        for step in range(1, p):
            src = (me - step) % p
            self._wait_flag(self._ready[src], me, seq, src, "post")
            off, n = out_chunks[src]
            ctypes.memmove(dst_ptr + off, self._base + self.layout.slot_offset(src, me, seq % k), n)
            self._store_wake(self._doneflag[src, me], seq % k, seq)
        self._pending.discard(seq)

    def _store_wake(self, flags: np.ndarray, i: int, value: int) -> None:
        """Store ``flags[i] = value`` and wake its waiter (natively only when it may sleep)."""
        if self._lib is not None:
            self._lib.raymoe_flag_store_wake(flag_address(flags, i), value)
        else:
            flags[i] = value
            futex_wake(flag_address(flags, i))

    def _wait_flag(self, flags: np.ndarray, i: int, target: int, peer: int, what: str) -> None:
        """Wait for ``flags[i] >= target`` (set by ``peer``): a short spin, then sleep on the flag's futex
        (``raymoe.platform.cpu.futex``), so a rank that waits leaves the CPU to the peer it waits for."""
        if self._lib is not None:
            if self._lib.raymoe_flag_wait_ge(flag_address(flags, i), target, self.timeout_s, self.spin_ns):
                self._timed_out(peer, what, target)
            return
        wait_flag_ge(flags, i, target, self.timeout_s, what=f"shared-memory all-to-all: rank {peer} did not {what}")


def _check_tensors(out: torch.Tensor, inp: torch.Tensor) -> None:
    """Raise ValueError unless ``out`` and ``inp`` are contiguous CPU tensors of one dtype."""
    if not (out.is_contiguous() and inp.is_contiguous()) or out.device.type != "cpu" or inp.dtype != out.dtype:
        raise ValueError("shared-memory collectives need contiguous CPU tensors of one dtype")


def _chunks(t: torch.Tensor, splits: list[int] | None, p: int) -> list[tuple[int, int]]:
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
