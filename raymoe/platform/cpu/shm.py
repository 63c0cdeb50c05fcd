"""Shared-memory all-to-all between the CPU ranks of one process group on one node.

gloo moves even a few kilobytes through the TCP loopback, and each exchange needs the kernel to wake the peer
process: about 2 ms per MoE layer between two ranks on two shared cores. Ranks of one node can instead exchange
through one shared mapping (``raymoe.platform.cpu.shm_layout``), as the CPU communicators of vLLM and SGLang do for
all-reduce. This module does it for the MoE all-to-all (and the all-gather of the low-latency dispatch).

Every call is a collective: all ranks of the group make the same calls in the same order, so the ``n``-th call
has sequence number ``n`` on every rank. Posting call ``s`` copies the chunk for ``dst`` into slot ``s % K`` of
``(me, dst)`` (after ``dst`` has consumed call ``s - K`` from that slot) and then stores ``ready[me, dst] = s``;
waiting for it waits for ``ready[src, me] >= s``, copies the slot out and stores ``done[src, me, s % K] = s``.
Posting returns at once, so the ``_a``/``_b`` halves of a dispatch or combine overlap other work (two-batch
overlap) without a progress thread. Calls may be waited on in any order (two TBO children interleave), but call
``s - K`` must have been waited on before call ``s`` is posted: every rank runs the same sequence, so each peer
then has consumed it too (or will, without waiting for this rank), and no post can block forever. How flags are
waited on and raised is the group's protocol (``raymoe.platform.cpu.shm_protocol``: futexes from Python, or the C
exchange, which also posts and receives equal chunks in one call each).

Ordering: the flag store follows the data copy in program order, and x86-64 (TSO) keeps stores in order as seen
by other cores, so a reader that sees the flag sees the data (glibc's ``memmove`` ends its non-temporal copies of
large blocks with an ``sfence``). :func:`~raymoe.platform.cpu.shm_layout.shm_supported` is False elsewhere, and
``cpu_comm="auto"`` then keeps gloo.

Copies are one ``memmove`` (``ctypes``) each between precomputed addresses, not tensor slices: a message is a few
kilobytes in a decode step, and three tensor calls per copy took longer than the copy (about 60 against 15
microseconds per two-rank all-gather post).
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import torch
import torch.distributed as dist

from raymoe.platform.cpu.kernels import build
from raymoe.platform.cpu.shm_layout import (
    DEFAULT_BUDGET_BYTES,
    LINE,
    ShmLayout,
    check_tensors,
    chunks,
    default_spin_ns,
    map_shared,
)
from raymoe.platform.cpu.shm_protocol import NativeFlags, PythonFlags

ABORTED_FLAG = 1 << 62
"""The value :meth:`ShmAllToAll.abort` stores in every flag: past any call number, so every wait returns."""


class ShmAborted(RuntimeError):
    """A call of an aborted :class:`ShmAllToAll` returned (its data is garbage)."""


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
            self._comm._receive(self._seq, self._out, self._chunks, self._chunk_bytes)
            self._done = True
        return True


class ShmAllToAll:
    """All-to-all over a shared mapping among the ``P`` ranks of a group (all on this node; CPU tensors only).

    Build it with :meth:`create` (collective over the group); the mapping lives as long as the process. Messages
    are byte ranges of contiguous CPU tensors; a message larger than ``slot_bytes`` cannot go through (check
    :meth:`fits`; callers then use gloo, deciding from sizes every rank knows, so all ranks choose alike).

    Args:
        rank, layout: this rank's index in the group and the mapping's geometry.
        buf: the mapping (``mmap``), kept open for the communicator's life.
        timeout_s: how long :meth:`ShmWork.wait` and slot reuse wait for a peer, seconds.
        native: use the C protocol (``shm_protocol.NativeFlags``). Every rank of the group must pass the same
            value (:meth:`create` agrees on it); True needs the kernel library (``kernels.build.load()``).
        spin_ns: how long a native wait spins before it sleeps, nanoseconds (None: ``default_spin_ns``).
    Raises:
        RuntimeError: ``native`` without the kernel library.
    """

    def __init__(self, rank: int, layout: ShmLayout, buf: mmap.mmap, timeout_s: float = 60.0,
                 native: bool = False, spin_ns: int | None = None):
        self.rank, self.layout, self.timeout_s = rank, layout, timeout_s
        self.spin_ns = default_spin_ns(layout.size) if spin_ns is None else spin_ns
        lib = build.load() if native else None
        if native and lib is None:
            raise RuntimeError("native shared-memory exchange needs raymoe's C kernel library, which is not loaded")
        self.flags = NativeFlags(lib, timeout_s, self.spin_ns) if native else PythonFlags(timeout_s)
        self._buf = buf
        self._bytes = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping's buffer exported (and alive)
        self._base = self._bytes.data_ptr()
        p = layout.size
        ctl = np.frombuffer(buf, dtype=np.int64, count=layout.control_entries * LINE).reshape(-1, LINE)[:, 0]
        self._ready = ctl[:p * p].reshape(p, p)
        self._doneflag = ctl[p * p:].reshape(p, p, layout.num_slots)
        self._seq = 0
        self._pending: set[int] = set()  # calls this rank posted and has not waited on

    @property
    def native(self) -> bool:
        """Whether this communicator runs the C protocol."""
        return self.flags.native

    @classmethod
    def create(cls, group: dist.ProcessGroup, slot_bytes: int | None = None, num_slots: int = 8,
               timeout_s: float = 60.0, native: bool | None = None) -> ShmAllToAll:
        """Map the group's shared file (``shm_layout.map_shared``, collective) and agree on the protocol.

        Defaults: 8 slots per pair, as two-batch overlap over a DeepSeek layer keeps up to 5 calls in flight (a
        normal-mode dispatch is three calls: counts, rows, ids). ``slot_bytes`` None shares
        :data:`~raymoe.platform.cpu.shm_layout.DEFAULT_BUDGET_BYTES` of ``/dev/shm`` among the
        ``P * P * num_slots`` slots, within [256 KiB, 8 MiB] per slot (4 MiB at P = 2, 1 MiB at P = 4); a larger
        message goes through gloo. ``native`` None or True runs the C protocol when every rank has the kernel
        library (one all-reduce over ``group`` agrees on it; check :attr:`native`), False never does.

        Raises:
            OSError: ``/dev/shm`` cannot hold the mapping (raised on every rank alike).
        """
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if slot_bytes is None:
            slot_bytes = min(max(DEFAULT_BUDGET_BYTES // (size * size * num_slots), 256 << 10), 8 << 20)
        layout = ShmLayout(size, num_slots, slot_bytes)
        buf = map_shared(group, layout)
        have = torch.tensor([int(native is not False and build.load() is not None)])
        dist.all_reduce(have, op=dist.ReduceOp.MIN, group=group)
        return cls(rank, layout, buf, timeout_s, native=bool(have.item()))

    @property
    def size(self) -> int:
        return self.layout.size

    def abort(self) -> None:
        """End every wait of every rank mapping this group: each flag is set past any call number and woken, so
        a wait returns at once, and every rank's calls raise ``ShmAborted`` (before posting, and once their
        receive returns: a post under way when the abort came raises at its wait). The protocol never uses the
        diagonal ``ready[r, r]``: set there too, it tells every process of the group that the mapping is aborted.
        Called from another thread of a rank whose step is stuck waiting for a peer that died (an elastic shrink,
        ``RankWorker.reform``); the mapping is not used again (the ranks' next groups map a new one). Data a call
        copied after the abort is garbage and never used: it raises."""
        p, k = self.size, self.layout.num_slots
        for a in range(p):
            self.flags.store_wake(self._ready[a], a, ABORTED_FLAG)  # the marker first: no new post overwrites
        for a in range(p):
            for b in range(p):
                self.flags.store_wake(self._ready[a], b, ABORTED_FLAG)
                for s in range(k):
                    self.flags.store_wake(self._doneflag[a, b], s, ABORTED_FLAG)

    @property
    def aborted(self) -> bool:
        """Whether some rank of the group aborted the mapping (:meth:`abort`)."""
        return int(self._ready[self.rank, self.rank]) >= ABORTED_FLAG

    def _check_aborted(self) -> None:
        if self.aborted:
            raise ShmAborted("shared-memory all-to-all aborted (the rank group is being reformed)")

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
        check_tensors(out, inp)
        if self.flags.native and in_splits is None and out_splits is None:
            total = inp.numel() * inp.element_size()
            if total % p or out.numel() * out.element_size() != total:
                raise ValueError(f"{total} bytes do not split into {p} equal chunks of the output's size")
            return self._post_equal(out, inp, total // p, total // p)
        return self._post(out, inp, chunks(inp, in_splits, p), chunks(out, out_splits, p))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> ShmWork:
        """Post an all-gather: all of ``inp`` goes to every rank, chunk ``s`` of ``out`` (equal chunks of dim 0)
        comes from rank ``s``. Returns at once; a collective like :meth:`all_to_all_single` (same ring).

        Args:
            out: contiguous CPU tensor, ``P`` times ``inp``'s bytes. inp: contiguous CPU tensor of ``out``'s dtype.
        Raises:
            ValueError: as :meth:`all_to_all_single`, or ``out`` not ``P`` times the size of ``inp``.
        """
        p = self.size
        check_tensors(out, inp)
        if out.numel() != p * inp.numel():
            raise ValueError(f"all-gather output of {out.numel()} elements is not {p} x {inp.numel()}")
        if self.flags.native:
            return self._post_equal(out, inp, 0, inp.numel() * inp.element_size())
        return self._post(out, inp, [(0, inp.numel() * inp.element_size())] * p, chunks(out, None, p))

    def _next_seq(self) -> int:
        """Number the next call and record it in flight. Raises RuntimeError: the ring's slot is still held."""
        seq, k = self._seq + 1, self.layout.num_slots
        if self._pending and min(self._pending) <= seq - k:
            raise RuntimeError(f"shared-memory all-to-all call {min(self._pending)} is posted and not waited on, "
                               f"and call {seq} needs its slot (at most {k} calls in flight)")
        self._seq = seq
        self._pending.add(seq)
        return seq

    def _post_equal(self, out: torch.Tensor, inp: torch.Tensor, stride: int, nbytes: int) -> ShmWork:
        """An equal-chunk call in one C call (``NativeFlags.post_equal``)."""
        if nbytes > self.layout.slot_bytes:
            raise ValueError(f"a chunk exceeds the shared-memory slot of {self.layout.slot_bytes} bytes")
        self._check_aborted()
        seq = self._next_seq()
        self.flags.post_equal(self._base, self.layout, self.rank, seq, inp, stride, nbytes, out)
        return ShmWork(self, seq, out, None, nbytes)

    def _post(self, out: torch.Tensor, inp: torch.Tensor, in_chunks: list[tuple[int, int]],
              out_chunks: list[tuple[int, int]]) -> ShmWork:
        """Copy chunk ``in_chunks[d]`` of ``inp`` into this call's slot for each peer ``d`` (and our own chunk into
        ``out``), then raise the peers' ready flags."""
        p = self.size
        if max(n for _, n in in_chunks + out_chunks) > self.layout.slot_bytes:
            raise ValueError(f"a chunk exceeds the shared-memory slot of {self.layout.slot_bytes} bytes")
        self._check_aborted()
        seq, me, k = self._next_seq(), self.rank, self.layout.num_slots
        src, dst_ptr = inp.data_ptr(), out.data_ptr()
        for step in range(1, p):
            dst = (me + step) % p
            self.flags.wait(self._doneflag[me, dst], seq % k, seq - k, dst, "free its slot")
            off, n = in_chunks[dst]
            ctypes.memmove(self._base + self.layout.slot_offset(me, dst, seq % k), src + off, n)
            self.flags.store_wake(self._ready[me], dst, seq)
        (o_off, o_n), (i_off, _) = out_chunks[me], in_chunks[me]
        ctypes.memmove(dst_ptr + o_off, src + i_off, o_n)
        return ShmWork(self, seq, out, out_chunks)

    def _receive(self, seq: int, out: torch.Tensor, out_chunks: list[tuple[int, int]] | None,
                 chunk_bytes: int) -> None:
        """Receive call ``seq``: the peers' chunks at ``out_chunks`` of ``out``, or (None) equal chunks of
        ``chunk_bytes`` through the C protocol."""
        if out_chunks is None:
            self.flags.receive_equal(self._base, self.layout, self.rank, seq, out, chunk_bytes)
            self._pending.discard(seq)
            self._check_aborted()
            return
        p, me, k = self.size, self.rank, self.layout.num_slots
        dst_ptr = out.data_ptr()
        for step in range(1, p):
            src = (me - step) % p
            self.flags.wait(self._ready[src], me, seq, src, "post")
            off, n = out_chunks[src]
            ctypes.memmove(dst_ptr + off, self._base + self.layout.slot_offset(src, me, seq % k), n)
            self.flags.store_wake(self._doneflag[src, me], seq % k, seq)
        self._pending.discard(seq)
        self._check_aborted()
