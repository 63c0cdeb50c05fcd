"""CPU ranks leave a core to the front end: thread counts derived per node, and the option's bounds."""

from __future__ import annotations

import os

import pytest

from raymoe.config import EngineConfig
from raymoe.errors import InvalidRequestError
from raymoe.platform.interface import rank_cpu_threads


def test_derived_threads_leave_one_core(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert rank_cpu_threads(None, 1) == 15
    assert rank_cpu_threads(None, 4) == 3
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert rank_cpu_threads(None, 1) == 1 and rank_cpu_threads(None, 2) == 1
    assert rank_cpu_threads(6, 2) == 6


def test_cpu_threads_option_is_checked(tiny_model):
    with pytest.raises(InvalidRequestError) as ei:
        EngineConfig(model=tiny_model, cpu_threads=0)
    assert ei.value.field == "cpu_threads"


def test_step_thread_priority_is_per_thread_and_failures_are_logged(monkeypatch, caplog):
    """The nice value lands on the calling thread only (the rank's step thread), None leaves it alone, and a
    process without the privilege keeps its priority with a warning instead of failing the rank."""
    import threading

    from raymoe.platform.cpu import process as process_tuning

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def step_thread() -> None:
        seen["set"] = process_tuning.raise_step_thread_priority(before + 3)  # raising nice needs no privilege
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=step_thread)
    t.start()
    t.join()
    assert seen == {"set": before + 3, "nice": before + 3}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # other threads keep theirs
    assert process_tuning.raise_step_thread_priority(None) is None

    def denied(*_args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", denied)
    with caplog.at_level("WARNING", logger=process_tuning.__name__):
        assert process_tuning.raise_step_thread_priority(-20) is None
    assert "cpu_rank_nice" in caplog.text


def test_cpu_rank_nice_option_is_checked(tiny_model):
    with pytest.raises(InvalidRequestError) as ei:
        EngineConfig(model=tiny_model, cpu_rank_nice=-21)
    assert ei.value.field == "cpu_rank_nice"
    assert EngineConfig(model=tiny_model, cpu_rank_nice=0).cpu_rank_nice == 0


def test_engine_process_nice_reaches_every_live_thread(monkeypatch):
    """Every thread of the actor process gets the value; a thread that ended between listing and renicing is
    skipped, not the end of the loop."""
    from raymoe.actors import process_tuning

    monkeypatch.setattr(os, "listdir", lambda path: ["101", "102", "103"])

    def getpriority(_which, tid):
        if tid == 102:
            raise ProcessLookupError(3, "No such process")
        return 15

    calls = []
    monkeypatch.setattr(os, "getpriority", getpriority)
    monkeypatch.setattr(os, "setpriority", lambda _which, tid, nice: calls.append((tid, nice)))
    assert process_tuning.set_engine_process_nice(0) is True
    assert calls == [(101, 0), (103, 0)]


_FREEZE_PROBE = """
import gc, weakref
from raymoe.actors.process_tuning import freeze_startup_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    return a

startup = [cycle() for _ in range(20000)]          # long-lived start-up state (a model, an app)
garbage = cycle(); dead_before = weakref.ref(garbage); del garbage   # a start-up cycle nobody holds
gc.disable()                                        # no automatic collection may blur the counts below
tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
tracked_after = len(gc.get_objects())
later = cycle(); dead_after = weakref.ref(later); del later          # a cycle made while serving
gc.collect()
print(frozen == gc.get_freeze_count(), frozen > 40000, tracked_before > 40000, tracked_after < 1000,
      dead_before() is None, dead_after() is None)
"""


def test_freeze_startup_heap_exempts_startup_objects_and_still_collects_new_cycles():
    """After the freeze a full collection no longer visits the start-up heap (the tracked set shrinks to the
    objects made since), start-up garbage cycles were collected first, and cycles made later are still collected.
    Run in a child process: freezing the test runner's own heap would outlive this test."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 6, out.stdout
