"""Blocking flag waits (``raymoe.platform.cpu.futex``): a waiter in another process sleeps until the flag is raised,
wakes within a bounded time, costs no CPU while it sleeps, and times out with a clear error."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import time

import numpy as np
import pytest

from raymoe.platform.cpu.futex import flag_address, futex_supported, futex_wake, wait_flag_ge

pytestmark = pytest.mark.skipif(not futex_supported(), reason="needs Linux futex(2)")


def _flags(buf: mmap.mmap) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.int64, count=16)[::8]  # two flags, each on its own cache line


def _waiter(buf, ready, out) -> None:
    flags = _flags(buf)
    c0 = time.process_time()
    ready.set()
    wait_flag_ge(flags, 1, 3, timeout_s=60.0)
    out.put((int(flags[1]), time.process_time() - c0))


def test_a_waiter_in_another_process_sleeps_until_the_flag_is_raised():
    """No wall-clock bound: the waiter must not return on a wake below its target (checked while it waits), must
    return once the target is stored (a generous 30 s bound on progress), and must sleep rather than poll (its CPU
    time, which load does not inflate)."""
    buf = mmap.mmap(-1, 4096)
    flags = _flags(buf)
    ctx = mp.get_context("fork")
    ready, out = ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_waiter, args=(buf, ready, out))
    p.start()
    assert ready.wait(timeout=30), "the waiter process did not start"
    time.sleep(0.2)  # not a synchronization: the longer the waiter waits below its target, the stronger the check
    flags[1] = 2  # below the target: the waiter keeps waiting
    futex_wake(flag_address(flags, 1))
    time.sleep(0.3)
    assert out.empty(), "the waiter returned below its target"
    flags[1] = 3
    futex_wake(flag_address(flags, 1))
    seen, cpu = out.get(timeout=30)
    p.join(timeout=30)
    assert seen == 3
    # it slept: a polling waiter burns its whole wait (> 0.5 s) in CPU time; a sleeping one measured 0.001 s
    assert cpu < 0.3


def test_a_wait_times_out_naming_what_it_waited_for():
    flags = _flags(mmap.mmap(-1, 4096))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 did not post for call 5 within 0.2 s"):
        wait_flag_ge(flags, 0, 5, timeout_s=0.2, what="rank 1 did not post")
    assert time.monotonic() - t0 >= 0.2  # never before its timeout (an upper bound would measure the machine's load)
    flags[0] = 7
    wait_flag_ge(flags, 0, 5, timeout_s=0.2)  # already there: returns at once


def _native_lines(buf: mmap.mmap) -> tuple[np.ndarray, int]:
    """int64 view of two control lines (flag at [i, 0], waiter word at [i, 1]) and the mapping's address."""
    lines = np.frombuffer(buf, dtype=np.int64, count=16).reshape(2, 8)
    return lines, lines.ctypes.data


def _native_waiter(buf, out) -> None:
    from raymoe.platform.cpu.kernels import build

    lines, base = _native_lines(buf)
    t0, c0 = time.monotonic(), time.process_time()
    rc = build.load().raymoe_flag_wait_ge(base + 64, 3, 60.0, 5000)
    out.put((rc, time.monotonic() - t0, time.process_time() - c0))


def test_a_native_waiter_announces_its_sleep_and_the_store_wakes_it():
    """The C protocol (``csrc/shm_exchange.c``): the waiter sets the waiter word beside its flag before it sleeps
    and clears it when it returns; a store below the target leaves it asleep, the store of the target wakes it."""
    from raymoe.platform.cpu.kernels import build

    lib = build.load()
    if lib is None:
        pytest.skip("the C kernel library cannot be built here")
    buf = mmap.mmap(-1, 4096)
    lines, base = _native_lines(buf)
    out = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_native_waiter, args=(buf, out))
    p.start()
    deadline = time.monotonic() + 30
    while lines[1, 1] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lines[1, 1] == 1, "the waiter never announced that it sleeps"
    lib.raymoe_flag_store_wake(base + 64, 2)  # below the target: it goes back to sleep
    time.sleep(0.5)
    assert out.empty()
    lib.raymoe_flag_store_wake(base + 64, 3)
    rc, waited, cpu = out.get(timeout=30)
    p.join(timeout=30)
    assert rc == 0 and lines[1, 0] == 3 and lines[1, 1] == 0
    # waited >= 0.5 by causality (the waiter's clock started before it announced its sleep, the parent then slept
    # 0.5 s before storing the target), whatever the load; it slept rather than polled: CPU time, not wall time
    assert waited >= 0.5 and cpu < 0.3
    assert lines[0, 0] == 0 and lines[0, 1] == 0  # the neighbouring line is untouched


def test_a_native_wait_times_out_and_a_raised_flag_returns_at_once():
    from raymoe.platform.cpu.kernels import build

    lib = build.load()
    if lib is None:
        pytest.skip("the C kernel library cannot be built here")
    lines, base = _native_lines(mmap.mmap(-1, 4096))
    t0 = time.monotonic()
    assert lib.raymoe_flag_wait_ge(base, 5, 0.2, 5000) == -1
    assert time.monotonic() - t0 >= 0.2 and lines[0, 1] == 0  # not before the timeout; no upper bound (load)
    lib.raymoe_flag_store_wake(base, 7)  # nobody waits: the flag is stored, the waiter word stays clear
    assert lines[0, 0] == 7 and lines[0, 1] == 0
    assert lib.raymoe_flag_wait_ge(base, 5, 0.2, 5000) == 0
