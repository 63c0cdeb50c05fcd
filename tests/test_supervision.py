"""Fault scope without Ray or a model: a fake executor stands in for the ranks, so every fault is injected at
an exact place. One bad request fails alone (its KV freed, the others finish); a rank that raises fails only
that step's requests and keeps the ranks; a rank fault restarts them; the loop survives internal errors, and a
dead loop is noticed, reported and restarted by the supervisor; the idle invariant holds at the end."""

from __future__ import annotations

import threading
import time

import pytest
from idle import assert_idle

from raymoe.actors.driver import Driver
from raymoe.actors.driver_service import AddRequest, DriverService, RequestDelta
from raymoe.actors.executor import RankFailure, RankStepError
from raymoe.config import CacheConfig, EngineConfig, SchedulerConfig
from raymoe.errors import EngineUnhealthyError, InvalidRequestError, RequestFailedError
from raymoe.scheduler.req import FinishKind
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.step_output import StepOutput

EOS = 0
VOCAB = 100


def fake_token(last: int, seq_len: int) -> int:
    """The fake model's next token after token ``last`` at sequence length ``seq_len`` (tokens): never EOS, and
    different requests get different sequences, so tokens delivered to the wrong request show."""
    return (31 * last + 7 * seq_len) % (VOCAB - 1) + 1


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens the fake model generates for ``prompt`` run alone (greedy, no EOS)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(fake_token(seq[-1], len(seq)))
    return seq[len(prompt):]


class FakeExecutor:
    """Answers each row with ``fake_token`` of its last input token and its sequence length (a function of the
    request's own tokens and position); resolves overlap scheduling's placeholders ``-(i + 1)`` from the group's
    previous step, as the ranks do (``raymoe.runner.future_tokens``). ``fail_next`` makes steps raise; counts
    restarts."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.fail_next: list[Exception] = []
        self.alive = True
        self.restarts = 0
        self.steps = 0
        self.latest: dict[int, list[int]] = {}  # DP group -> tokens of its latest step, by row

    def execute(self, batches):
        self.steps += 1
        time.sleep(self.delay_s)
        if self.fail_next:
            raise self.fail_next.pop(0)
        outs = []
        for g, b in enumerate(batches):
            latest = self.latest.setdefault(g, [0] * 64)  # a row no step sampled reads a stale 0, never raises
            ends = [sum(b.extend_lens[:j + 1]) - 1 for j in range(b.batch_size)]
            last = [latest[-t - 1] if t < 0 else t for t in (b.input_ids[e] for e in ends)]
            tokens = [fake_token(t, n) for t, n in zip(last, b.seq_lens, strict=True)]
            latest[:len(tokens)] = tokens
            outs.append(StepOutput(tokens))
        return outs

    def launch(self, batches):  # overlap scheduling: run now, report at collect (errors included)
        try:
            return self.execute(batches)
        except Exception as e:  # noqa: BLE001
            return e

    def collect(self, handle):
        if isinstance(handle, Exception):
            raise handle
        return handle

    def ranks_alive(self) -> bool:
        return self.alive

    def restart(self) -> None:
        self.restarts += 1
        self.alive = True


def detokenize(ids) -> str:
    return " ".join(map(str, ids))


def make_driver(dp: int = 2, executor: FakeExecutor | None = None, detok=detokenize) -> Driver:
    config = EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=256, max_context_len=128),
                          scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=None))
    return Driver(config, executor or FakeExecutor(), [EOS], detok, dp_size=dp, vocab_size=VOCAB)


def run_all(driver: Driver, limit: int = 200) -> dict:
    done = {}
    for _ in range(limit):
        if not driver.has_unfinished():
            break
        done.update({r.rid: r for r in driver.step() if r.finished})
    return done


def step_results(driver: Driver, tries: int = 3) -> list:
    """The first non-empty ``step()`` answer (with overlap scheduling a step's results come one call later)."""
    for _ in range(tries):
        if out := driver.step():
            return out
    return []


def test_a_request_whose_stop_check_raises_fails_alone_and_frees_its_kv():
    def detok(ids):
        if "poison" in calls:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad bytes")
        return detokenize(ids)

    calls: set[str] = set()
    d = make_driver(detok=detok)
    good = [d.add_request(f"ok{i}", [1, 2, 3 + i], SamplingParams(max_tokens=4, temperature=0)) for i in range(3)]
    d.add_request("bad", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0, stop=("zz",)))
    calls.add("poison")  # only the request with stop strings detokenizes
    done = run_all(d)
    assert {r.rid for r in good} <= done.keys() and "bad" in done
    assert all(done[r.rid].finished_reason.kind == FinishKind.LENGTH for r in good)
    assert [done[r.rid].output_ids for r in good] == [expected_tokens([1, 2, 3 + i], 4) for i in range(3)]
    reason = done["bad"].finished_reason
    assert reason.kind == FinishKind.ERROR and reason.fault.kind == "failed"
    assert "UnicodeDecodeError" in reason.fault.message and "Traceback" not in reason.fault.message
    assert_idle(d)


def test_a_row_that_cannot_be_built_fails_alone():
    d = make_driver(dp=1)
    ok = d.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    bad = d.add_request("bad", [1, 2, 4], SamplingParams(max_tokens=3, temperature=0))
    object.__setattr__(bad.sampling_params, "top_k", 2**70)  # as if validation had missed it
    done = run_all(d)
    assert done["ok"] is ok and ok.output_ids == expected_tokens([1, 2, 3], 3)
    fault = done["bad"].finished_reason.fault
    assert (fault.kind, fault.field) == ("invalid", "top_k")
    assert_idle(d)


def test_values_the_ranks_cannot_hold_are_refused_at_add_time():
    d = make_driver(dp=1)
    with pytest.raises(InvalidRequestError) as e:
        d.add_request("big-seed", [1, 2], SamplingParams(seed=2**64))
    assert e.value.field == "seed"
    small_vocab = Driver(d.config, FakeExecutor(), [EOS], detokenize, vocab_size=10)
    with pytest.raises(InvalidRequestError) as e:
        small_vocab.add_request("too-many", [1, 2], SamplingParams(logprobs=11))
    assert e.value.field == "logprobs"


def test_a_step_a_rank_raised_in_fails_its_requests_and_keeps_the_ranks():
    ex = FakeExecutor()
    d = make_driver(executor=ex)
    first = [d.add_request(f"a{i}", [1, 2, i + 3], SamplingParams(max_tokens=3, temperature=0)) for i in range(2)]
    ex.fail_next = [RankStepError("a rank raised ValueError in a step")]
    failed = step_results(d)
    assert {r.rid for r in failed} == {r.rid for r in first}
    assert all(r.finished_reason.fault.kind == "failed" for r in failed)
    assert ex.restarts == 0 and d.num_failed_steps == 1
    assert_idle(d)
    later = d.add_request("later", [9, 9], SamplingParams(max_tokens=2, temperature=0))
    assert run_all(d)["later"] is later and later.finished_reason.kind == FinishKind.LENGTH
    assert later.output_ids == expected_tokens([9, 9], 2)  # as if nothing had failed before it


def test_a_second_failed_step_in_a_row_or_a_silent_rank_is_a_rank_fault():
    ex = FakeExecutor()
    d = make_driver(executor=ex)
    d.add_request("a", [1, 2], SamplingParams(max_tokens=5, temperature=0))
    ex.fail_next = [RankStepError("x")]
    assert step_results(d)
    d.add_request("b", [1, 3], SamplingParams(max_tokens=5, temperature=0))
    ex.fail_next = [RankStepError("x")]
    with pytest.raises(RankFailure):
        step_results(d)
    d.reset()
    d.add_request("c", [1, 4], SamplingParams(max_tokens=5, temperature=0))
    ex.alive = False
    ex.fail_next = [RankStepError("x")]
    with pytest.raises(RankFailure):
        step_results(d)


class Collector:
    """A ``publish`` target: every delta by request id; ``ended`` once a request's last delta arrived."""

    def __init__(self):
        self.deltas: dict[str, list[RequestDelta]] = {}
        self.lock = threading.Lock()

    def __call__(self, batch) -> None:
        with self.lock:
            for d in batch:
                self.deltas.setdefault(d.request_id, []).append(d)

    def last(self, rid: str) -> RequestDelta | None:
        with self.lock:
            ds = self.deltas.get(rid)
            return ds[-1] if ds and ds[-1].finished else None

    def tokens(self, rid: str) -> list[int]:
        """Every token streamed to ``rid``, in order."""
        with self.lock:
            return [t for d in self.deltas.get(rid, ()) for t in d.token_ids]


def wait_until(pred, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def prompt_of(i: int) -> list[int]:
    return [1, 2, i % 50 + 3]


def adds(prefix: str, n: int, max_tokens: int = 3, **kw) -> list[AddRequest]:
    return [AddRequest(f"{prefix}{i}", prompt_of(i), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))
            for i in range(n)]


def assert_own_tokens(out: Collector, prefix: str, n: int, max_tokens: int = 3) -> None:
    """Each of ``prefix0 ..`` got all its tokens and exactly those of its prompt run alone (undisturbed)."""
    want = [expected_tokens(prompt_of(i), max_tokens) for i in range(n)]
    assert len({tuple(w) for w in want}) == n  # pairwise different: a mix-up between them would show
    assert [out.tokens(f"{prefix}{i}") for i in range(n)] == want


@pytest.fixture
def service():
    out = Collector()
    ex = FakeExecutor(delay_s=0.01)
    svc = DriverService(make_driver(executor=ex), publish=out, supervise_interval_s=0.05, restart_backoff_s=0.5)
    svc.out, svc.ex = out, ex
    yield svc
    svc.shutdown()


def test_rank_fault_restarts_ranks_and_counts_it(service):
    service.ex.fail_next = [RankFailure("a rank died")]
    service.submit(adds("r", 3, max_tokens=50))
    wait_until(lambda: all(service.out.last(f"r{i}") for i in range(3)))
    assert all(service.out.last(f"r{i}").error.kind == "unhealthy" for i in range(3))
    wait_until(service.healthy)
    assert service.stats().rank_restarts == 1 and service.ex.restarts == 1
    service.submit(adds("after", 2))
    wait_until(lambda: all(service.out.last(f"after{i}") for i in range(2)))
    assert service.out.last("after0").finish_reason == "length"
    assert_own_tokens(service.out, "after", 2)


@pytest.mark.parametrize(("error", "detail"), [
    (TimeoutError("could not place 2 TP groups of {'GPU': 1} x 2 within 20 s"), "could not place 2 TP groups"),
    (RuntimeError("secret host 10.0.0.7"), "(RuntimeError)")])
def test_a_rank_group_that_cannot_be_rebuilt_says_why_in_health(service, error, detail):
    """A restart that fails (no node has room for the placement groups) leaves the engine unhealthy, and its
    health detail names the placement shortfall; other restart errors are named by type only."""
    def failing_restart():
        service.ex.restarts += 1
        raise error

    service.ex.restart = failing_restart
    service.ex.fail_next = [RankFailure("a rank died")]
    service.submit(adds("r", 1, max_tokens=50))
    wait_until(lambda: "restarting the rank group failed" in service.health_detail())
    assert detail in service.health_detail() and "10.0.0.7" not in service.health_detail()
    assert not service.healthy() and service.ex.restarts == 1


def test_rank_step_error_fails_the_step_only(service):
    service.ex.fail_next = [RankStepError("a rank raised RuntimeError in a step")]
    service.submit(adds("s", 2))
    wait_until(lambda: all(service.out.last(f"s{i}") for i in range(2)))
    err = service.out.last("s0").error
    assert err.kind == "failed" and isinstance(err.to_exception(), RequestFailedError)
    service.submit(adds("t", 2))
    wait_until(lambda: all(service.out.last(f"t{i}") for i in range(2)))
    stats = service.stats()
    assert service.out.last("t1").finish_reason == "length"
    assert_own_tokens(service.out, "t", 2)
    assert (stats.rank_restarts, stats.failed_steps, stats.failed_requests) == (0, 1, 2) and stats.healthy


def test_an_internal_error_in_the_loop_fails_in_flight_requests_and_the_loop_goes_on(service):
    service.submit(adds("x", 3, max_tokens=100))
    wait_until(lambda: service.driver.num_steps > 2)
    service.inject_fault("loop_error")
    wait_until(lambda: all(service.out.last(f"x{i}") for i in range(3)))
    assert all(service.out.last(f"x{i}").error.kind == "failed" for i in range(3))
    service.submit(adds("y", 2))
    wait_until(lambda: all(service.out.last(f"y{i}") for i in range(2)))
    assert service.out.last("y0").finish_reason == "length"
    assert_own_tokens(service.out, "y", 2)
    assert service.stats().loop_restarts == 0
    wait_until(lambda: service.stats().idle_checked)
    assert_idle(service)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected death
def test_a_dead_loop_is_reported_its_requests_fail_new_ones_are_refused_and_it_restarts(service):
    # The checks below run while the loop is down: keep it down long enough for a loaded machine (the fixture's
    # 0.5 s left a window that a descheduled test thread could miss).
    service.restart_backoff_s = 3.0
    service.submit(adds("z", 3, max_tokens=100))
    wait_until(lambda: service.driver.num_steps > 2)
    service.inject_fault("loop_death")
    wait_until(lambda: all(service.out.last(f"z{i}") for i in range(3)))
    assert all(isinstance(service.out.last(f"z{i}").error.to_exception(), EngineUnhealthyError) for i in range(3))
    assert not service.healthy() and "died" in service.stats().health_detail
    service.submit(adds("during", 1))
    wait_until(lambda: service.out.last("during0"))
    assert service.out.last("during0").error.kind == "unhealthy"
    wait_until(service.healthy)
    assert service.stats().loop_restarts == 1
    service.submit(adds("w", 2))
    wait_until(lambda: all(service.out.last(f"w{i}") for i in range(2)))
    assert service.out.last("w1").finish_reason == "length"
    assert_own_tokens(service.out, "w", 2)
    wait_until(lambda: service.stats().idle_checked)
    assert_idle(service)


def test_an_output_that_cannot_be_built_fails_that_request_only(service, monkeypatch):
    from raymoe.actors.group_scheduler import GroupScheduler

    real = GroupScheduler._record

    def flaky(self, req):
        if req.rid == "p1":
            raise KeyError("boom")
        return real(self, req)

    monkeypatch.setattr(GroupScheduler, "_record", flaky)
    service.submit(adds("p", 3))
    wait_until(lambda: all(service.out.last(f"p{i}") for i in range(3)))
    assert service.out.last("p1").error.kind == "failed"
    assert service.out.last("p0").finish_reason == service.out.last("p2").finish_reason == "length"
    assert [service.out.tokens(f"p{i}") for i in (0, 2)] == [expected_tokens(prompt_of(i), 3) for i in (0, 2)]
    wait_until(lambda: service.stats().idle_checked)
    assert_idle(service)


def test_idle_invariant_reports_a_leak():
    d = make_driver(dp=1)
    d.add_request("leaky", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    run_all(d)
    d.schedulers[0].token_allocator.alloc(5)  # a leak: slots taken by nobody
    with pytest.raises(AssertionError, match="leaked_kv_slots=5"):
        assert_idle(d)
