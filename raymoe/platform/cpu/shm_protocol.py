"""How the ranks of a shared-memory all-to-all (``raymoe.platform.cpu.shm``) wait for and raise the mapping's
sequence flags: two protocols, one per group (all ranks agree on it when the group maps, ``ShmAllToAll.create``).

* :class:`PythonFlags`: a wait reads the flag, spins a few reads, then sleeps on its futex
  (``raymoe.platform.cpu.futex``); every store wakes the flag's futex (a system call, about a microsecond).
* :class:`NativeFlags` (every rank has raymoe's C kernel library, ``csrc/shm_exchange.c``): each flag's 64-byte line
  also holds a waiter word. The single waiter of a flag sets it (sequentially consistent) and re-reads the flag
  before it sleeps; the writer stores the flag, reads the word and makes the wake-up system call only when it is
  set (Dekker order: no lost wake-up; waits still sleep in bounded slices and re-check). A wait spins ``spin_ns``
  first. An equal-chunk post or receive (an all-gather, an equal all-to-all: the low-latency dispatch and combine)
  is then one C call: its slot waits, copies and flags.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from raymoe.platform.cpu.futex import flag_address, futex_wake, wait_flag_ge
from raymoe.platform.cpu.shm_layout import ShmLayout


class PythonFlags:
    """Flag waits and stores of the Python protocol (module docstring).

    Args:
        timeout_s: how long a wait lasts before it raises, seconds.
    """

    native = False

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def store_wake(self, flags: np.ndarray, i: int, value: int) -> None:
        """``flags[i] = value``, then wake its waiter."""
        flags[i] = value
        futex_wake(flag_address(flags, i))

    def wait(self, flags: np.ndarray, i: int, target: int, peer: int, what: str) -> None:
        """Wait for ``flags[i] >= target`` (raised by ``peer``).

        Raises:
            TimeoutError: naming the peer, what it did not do, the call and the timeout.
        """
        wait_flag_ge(flags, i, target, self.timeout_s, what=f"shared-memory all-to-all: rank {peer} did not {what}")


class NativeFlags(PythonFlags):
    """The C protocol (module docstring), with its equal-chunk posts and receives.

    Args:
        lib: raymoe's loaded kernel library (``kernels.build.load()``). timeout_s: as :class:`PythonFlags`.
        spin_ns: how long a wait spins before it sleeps, nanoseconds.
    """

    native = True

    def __init__(self, lib: ctypes.CDLL, timeout_s: float, spin_ns: int):
        super().__init__(timeout_s)
        self.lib, self.spin_ns = lib, spin_ns

    def store_wake(self, flags: np.ndarray, i: int, value: int) -> None:
        self.lib.raymoe_flag_store_wake(flag_address(flags, i), value)

    def wait(self, flags: np.ndarray, i: int, target: int, peer: int, what: str) -> None:
        if self.lib.raymoe_flag_wait_ge(flag_address(flags, i), target, self.timeout_s, self.spin_ns):
            raise _timed_out(peer, what, target, self.timeout_s)

    def post_equal(self, base: int, layout: ShmLayout, rank: int, seq: int, inp: torch.Tensor, stride: int,
                   nbytes: int, out: torch.Tensor) -> None:
        """Post call ``seq``: peer ``d`` gets ``nbytes`` from byte ``d * stride`` of ``inp`` (stride 0: an
        all-gather); this rank's own chunk lands in ``out`` at ``rank * nbytes``. ``base``: the mapping's address.

        Raises:
            TimeoutError: a peer did not free its slot (consume call ``seq - K``) in time.
        """
        rc = self.lib.raymoe_shm_post_equal(base, layout.control_bytes, layout.size, layout.num_slots,
                                            layout.slot_bytes, rank, seq, inp.data_ptr(), stride, nbytes,
                                            out.data_ptr(), self.timeout_s, self.spin_ns)
        if rc:
            raise _timed_out(-rc - 1, "free its slot", seq - layout.num_slots, self.timeout_s)

    def receive_equal(self, base: int, layout: ShmLayout, rank: int, seq: int, out: torch.Tensor,
                      nbytes: int) -> None:
        """Receive call ``seq``'s chunks of ``nbytes`` into ``out`` (chunk ``s`` from rank ``s``).

        Raises:
            TimeoutError: a peer did not post in time.
        """
        rc = self.lib.raymoe_shm_receive_equal(base, layout.control_bytes, layout.size, layout.num_slots,
                                               layout.slot_bytes, rank, seq, out.data_ptr(), nbytes,
                                               self.timeout_s, self.spin_ns)
        if rc:
            raise _timed_out(-rc - 1, "post", seq, self.timeout_s)


def _timed_out(peer: int, what: str, target: int, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"shared-memory all-to-all: rank {peer} did not {what} for call {target} within "
                        f"{timeout_s:.1f} s")
