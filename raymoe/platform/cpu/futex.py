"""Blocking waits on sequence flags in shared memory: Linux futexes, with a short spin first.

Processes that meet through a shared mapping (the CPU ranks' all-to-all, ``raymoe.platform.cpu.shm``) wait for a
peer to raise an int64 sequence flag. Polling such a flag (spin, ``sched_yield``, short sleeps) burns the CPU the
peer needs: on a 2-core machine with two rank processes, the driver, the HTTP front end and the client, a rank
that polls slows the rank it waits for. A futex lets the waiter sleep in the kernel until the writer wakes it
(``futex(2)``, FUTEX_WAIT / FUTEX_WAKE on a shared, non-private word), so a wait costs no CPU after its spin.

Protocol (no lost wake-ups): the writer stores the flag, then calls :func:`futex_wake` on its address. The waiter
reads the flag; while it is below its target it calls FUTEX_WAIT with the low 32 bits it just read. The kernel
sleeps only if the word still holds that value, so a store between the read and the sleep makes the call
return at once. Waits are bounded (``timeout_s``) and re-check the flag, so even a wake that never comes delays
a waiter by one bounded sleep, never forever.

The flag is an aligned int64; the futex word is its low half (x86-64 is little-endian). Sequence numbers only
grow, and a waiter compares against the value it read, so the 32-bit wrap of the word is harmless.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

import numpy as np

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    if _SYS_FUTEX is None or os.name != "posix" or platform.system() != "Linux":
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        fn = lib.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _libc()


def futex_supported() -> bool:
    """Whether this process can call ``futex(2)`` (Linux on x86-64 or aarch64)."""
    return _syscall is not None


def futex_wake(addr: int) -> None:
    """Wake every process sleeping in :func:`futex_wait` on ``addr`` (the address of a 32-bit word in a shared
    mapping). Costs one system call (about a microsecond) when nobody sleeps."""
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _INT_MAX, None, None, 0)


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (low 32 bits), at most ``timeout_s`` seconds.

    Returns on a wake, a changed word, a signal or the timeout, whichever comes first: callers re-check.
    """
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int32(expected & 0xFFFFFFFF).value,
             ctypes.byref(ts), None, 0)


def flag_address(flags: np.ndarray, i: int) -> int:
    """Byte address of ``flags[i]`` (a 1-D int64 view of a shared mapping)."""
    return flags.ctypes.data + i * flags.strides[0]


def wait_flag_ge(flags: np.ndarray, i: int, target: int, timeout_s: float, spins: int = 64,
                 what: str = "the peer did not raise its flag") -> None:
    """Wait until ``flags[i] >= target``: check, spin ``spins`` reads, then sleep on the futex in slices of at
    most 50 ms (each slice re-reads the flag).

    Without futex support the sleep is ``sched_yield`` then 20 us naps (the portable polling fallback).

    Raises:
        TimeoutError: the flag stayed below ``target`` for ``timeout_s`` seconds (the message is ``what``, then
            "for call {target} within {timeout_s} s").
    """
    for _ in range(spins + 1):
        if flags[i] >= target:
            return
    deadline = time.monotonic() + timeout_s
    addr = flag_address(flags, i)
    while True:
        cur = int(flags[i])
        if cur >= target:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} for call {target} within {timeout_s:.1f} s")
        if _syscall is not None:
            futex_wait(addr, cur, min(left, 0.05))
        else:
            os.sched_yield()
            time.sleep(20e-6)
