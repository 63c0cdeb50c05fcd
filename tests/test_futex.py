"""Blocking flag waits (``raymoe.comm.futex``): a waiter in another process sleeps until the flag is raised,
wakes within a bounded time, costs no CPU while it sleeps, and times out with a clear error."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import time

import numpy as np
import pytest

from raymoe.comm.futex import flag_address, futex_supported, futex_wake, wait_flag_ge

pytestmark = pytest.mark.skipif(not futex_supported(), reason="needs Linux futex(2)")


def _flags(buf: mmap.mmap) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.int64, count=16)[::8]  # two flags, each on its own cache line


def _waiter(buf, out) -> None:
    flags = _flags(buf)
    t0, c0 = time.monotonic(), time.process_time()
    wait_flag_ge(flags, 1, 3, timeout_s=20.0)
    out.put((time.monotonic() - t0, time.process_time() - c0))


def test_a_waiter_in_another_process_sleeps_until_the_flag_is_raised():
    buf = mmap.mmap(-1, 4096)
    flags = _flags(buf)
    out = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_waiter, args=(buf, out))
    p.start()
    time.sleep(0.5)
    flags[1] = 2  # below the target: the waiter keeps waiting
    futex_wake(flag_address(flags, 1))
    time.sleep(0.5)
    flags[1] = 3
    futex_wake(flag_address(flags, 1))
    waited, cpu = out.get(timeout=10)
    p.join(timeout=10)
    assert 0.9 <= waited < 5.0
    assert cpu < 0.3  # it slept: a polling waiter would have used about a second of CPU


def test_a_wait_times_out_naming_what_it_waited_for():
    flags = _flags(mmap.mmap(-1, 4096))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 did not post for call 5 within 0.2 s"):
        wait_flag_ge(flags, 0, 5, timeout_s=0.2, what="rank 1 did not post")
    assert time.monotonic() - t0 < 2.0
    flags[0] = 7
    wait_flag_ge(flags, 0, 5, timeout_s=0.2)  # already there: returns at once
