"""``raymoe bench profile-serve``'s accounting: blocked samples are not CPU, and a process's measured CPU is split
over the categories of its active samples only."""

import collections
import os

import pytest

from raymoe.bench.profile_serve import WAITING, classify, cpu_seconds, cpu_split, summarize


def test_blocked_leaves_are_waiting_not_their_caller():
    rank = "Thread.run (threading.py:982);serve_steps (raymoe/actors/step_channel.py:198)"
    assert classify((rank + ";ShmAllToAll._wait_flag (raymoe/platform/cpu/shm.py:266);"
                     "futex_wait (raymoe/platform/cpu/futex.py:69)").split(";")) == WAITING
    assert classify(["StepChannelHub.gather (raymoe/actors/step_channel.py:90)",
                     "_PollLikeSelector.select (selectors.py:415)"]) == WAITING
    assert classify(["BaseEventLoop._run_once (asyncio/base_events.py:1898)",
                     "EpollSelector.select (selectors.py:468)"]) == WAITING
    # the same callers, busy: their own categories
    assert classify(["RankWorker.step (raymoe/actors/rank_worker.py:111)",
                     "ModelRunner.forward (raymoe/runner/model_runner.py:200)"]) == "forward"
    assert classify(["ShmAllToAll._post (raymoe/platform/cpu/shm.py:249)",
                     "futex_wake (raymoe/platform/cpu/futex.py:60)"]) == "other"


def test_overlapped_fan_out_and_the_stream_relay_have_their_categories():
    # The driver sends a step in ``launch`` and waits in ``collect`` (overlap scheduling), not in ``execute``.
    loop = "DriverService._iterate (raymoe/actors/driver_service.py:281);Driver.step (raymoe/actors/driver.py:183)"
    assert classify((loop + ";Driver._launch_next (raymoe/actors/driver.py:215);RayExecutor.launch "
                     "(raymoe/actors/executor.py:224);StepChannelHub.send (raymoe/actors/step_channel.py:106);"
                     "Connection._send (multiprocessing/connection.py:384)").split(";")) == "fan-out"
    # A rank unpickling its step message or pickling its reply, outside the step itself.
    assert classify(["Thread.run (threading.py:982)", "serve_steps (raymoe/actors/step_channel.py:190)",
                     "ForkingPickler.dumps (multiprocessing/reduction.py:51)"]) == "fan-out"
    assert classify(["serve_steps (raymoe/actors/step_channel.py:190)", "RankWorker.step (a.py:1)",
                     "ModelRunner.forward (raymoe/runner/model_runner.py:200)"]) == "forward"
    assert classify(["EventRelay._pump (raymoe/deploy/sse.py:124)"]) == "SSE + HTTP"


def test_summarize_reads_py_spy_raw_lines(tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text("thread (1): MainThread;EngineClient.generate (a.py:1);futex_wait (f.py:2) 30\n"
                   "thread (1): MainThread;IncrementalDetokenizer.push (d.py:54) 10\n"
                   "not a sample line\n")
    assert summarize(raw) == collections.Counter({WAITING: 30, "detokenization": 10})


def test_cpu_split_gives_waiting_no_share():
    samples = collections.Counter({WAITING: 900, "forward": 75, "sampling": 25})
    split = cpu_split(samples, 4.0)
    assert split == pytest.approx({"forward": 3.0, "sampling": 1.0})
    assert cpu_split(collections.Counter({WAITING: 5}), 4.0) == {}


def test_cpu_seconds_of_this_process_grows_and_of_a_gone_process_is_zero():
    before = cpu_seconds(os.getpid())
    x = 0
    for i in range(3_000_000):
        x += i
    assert cpu_seconds(os.getpid()) > before
    assert cpu_seconds(2 ** 22 + 12345) == 0.0
