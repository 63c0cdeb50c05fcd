"""The step channel (``raymoe.actors.step_channel``) without Ray: ranks are threads serving a fake ``step``.

Checked: steps answered in order with each DP group's tp-rank-0 output; an abandoned step's reply never answers a
later step; a rank error is a ``RankStepError`` when every rank answered (channel healthy) and a ``RankFailure``
when another rank stays silent, raised a collective error, closed its socket, or the step passed its bound; a
socket nobody can reach makes the rank report it instead of failing.
"""

from __future__ import annotations

import threading

import pytest

from raymoe.actors.step_channel import StepChannelHub, connect_step_channel, serve_steps
from raymoe.actors.step_errors import RankFailure, RankStepError
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch

#: Step bound of the tests that expect an answer, seconds: progress, not speed (answers take milliseconds).
STEP_S = 60.0


def _batch(token: int) -> ModelWorkerBatch:
    return ModelWorkerBatch(ForwardMode.DECODE, [token], [0], [5], [4], [1], [9], sampling=SamplingInputs.greedy(1))


def _start(world: int, tp: int, step_for_rank, grace_s: float = 60.0) -> StepChannelHub:
    hub = StepChannelHub(world, tp, grace_s=grace_s)
    for r in range(world):
        conn = connect_step_channel(hub.path, hub.authkey, r)
        assert conn is not None
        threading.Thread(target=serve_steps, args=(conn, r, tp, step_for_rank(r)), daemon=True).start()
    hub.accept(60.0)
    return hub


def _echo(rank: int):
    def step(batch: ModelWorkerBatch) -> StepOutput:
        return StepOutput([batch.input_ids[0] * 10 + rank], [], 0.0)
    return step


def test_steps_come_back_in_order_with_each_groups_tp_rank0_output():
    hub = _start(4, 2, _echo)  # dp=2 groups of tp=2: ranks 0 and 2 answer for their groups
    try:
        first = hub.send([_batch(1), _batch(2)])
        second = hub.send([_batch(3), _batch(4)])  # two steps in flight, as overlap scheduling sends them
        assert [o.next_token_ids for o in hub.gather(first, STEP_S)] == [[10], [22]]
        assert [o.next_token_ids for o in hub.gather(second, STEP_S)] == [[30], [42]]
        # An abandoned step (the driver reset while it was in flight) does not answer the next one.
        hub.send([_batch(5), _batch(6)])
        latest = hub.send([_batch(7), _batch(8)])
        assert [o.next_token_ids for o in hub.gather(latest, STEP_S)] == [[70], [82]]
        assert hub.healthy
    finally:
        hub.close()


#: Released when a test ends, so that a "silent" rank thread never outlives its test.
_SILENCE = threading.Event()


@pytest.fixture(autouse=True)
def _release_silent_ranks():
    _SILENCE.clear()
    yield
    _SILENCE.set()


def _raising_rank(bad: int, exc: type[BaseException], silent_rank: int | None = None):
    def factory(rank: int):
        def step(batch):
            if rank == bad:
                raise exc("boom")
            if rank == silent_rank:
                _SILENCE.wait()  # never answers while the test runs
            return StepOutput([rank], [], 0.0)
        return step
    return factory


def test_an_ordinary_error_answered_by_every_rank_keeps_the_channel_healthy():
    hub = _start(2, 1, _raising_rank(1, ValueError))
    try:
        with pytest.raises(RankStepError, match="rank 1 raised ValueError"):
            hub.gather(hub.send([_batch(1), _batch(2)]), STEP_S)
        assert hub.healthy
    finally:
        hub.close()


def test_a_rank_silent_after_another_ranks_error_is_stuck():
    hub = _start(2, 1, _raising_rank(1, ValueError, silent_rank=0), grace_s=0.3)
    try:
        # The grace period, not the step bound, ends the step: the message tells them apart (no clock needed; the
        # step bound is far beyond any load, and reaching it would say "exceeded").
        with pytest.raises(RankFailure, match="stuck in a collective"):
            hub.gather(hub.send([_batch(1), _batch(2)]), 600.0)
        assert not hub.healthy
    finally:
        hub.close()


def test_a_collective_error_or_timeout_needs_a_restart():
    for exc in (TimeoutError, type("DistBackendError", (RuntimeError,), {})):
        hub = _start(2, 1, _raising_rank(0, exc))
        try:
            with pytest.raises(RankFailure, match="collectives failed"):
                hub.gather(hub.send([_batch(1), _batch(2)]), STEP_S)
            assert not hub.healthy
        finally:
            hub.close()


def test_a_step_past_its_bound_fails():
    hub = _start(2, 1, _raising_rank(-1, ValueError, silent_rank=1))
    try:
        with pytest.raises(RankFailure, match="exceeded"):
            hub.gather(hub.send([_batch(1), _batch(2)]), 0.3)
    finally:
        hub.close()


def test_a_rank_whose_socket_closes_is_a_rank_failure():
    hub = StepChannelHub(2, 1)
    conns = [connect_step_channel(hub.path, hub.authkey, r) for r in range(2)]
    threading.Thread(target=serve_steps, args=(conns[0], 0, 1, _echo(0)), daemon=True).start()
    hub.accept(60.0)
    try:
        conns[1].close()  # rank 1's process died
        with pytest.raises(RankFailure, match="rank 1 closed its step channel|a rank died"):
            hub.gather(hub.send([_batch(1), _batch(2)]), STEP_S)
        assert not hub.healthy
    finally:
        hub.close()


def test_an_unreachable_socket_is_reported_not_raised(tmp_path):
    assert connect_step_channel(str(tmp_path / "nowhere.sock"), b"k" * 32, 0) is None


def test_ranks_that_never_connect_time_out():
    hub = StepChannelHub(2, 1)
    connect_step_channel(hub.path, hub.authkey, 0)
    with pytest.raises(TimeoutError, match="did not all connect"):
        hub.accept(0.5)


def test_each_rank_receives_only_its_groups_batch():
    """A rank's message holds its own DP group's batch: its size does not grow with the number of groups."""
    sizes = {}
    for groups in (2, 8):
        seen: dict[int, list[int]] = {}

        def record(rank: int, seen=seen):
            def step(batch: ModelWorkerBatch) -> StepOutput:
                seen.setdefault(rank, []).append(batch.input_ids[0])
                return StepOutput([rank], [], 0.0)
            return step

        hub = _start(groups, 1, record)
        try:
            hub.gather(hub.send([_batch(g) for g in range(groups)]), 5.0)
            sizes[groups] = hub.last_bytes_per_rank
        finally:
            hub.close()
        assert seen == {g: [g] for g in range(groups)}
    assert sizes[2] == sizes[8] > 0
