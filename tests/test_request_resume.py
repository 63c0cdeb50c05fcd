"""Resuming requests after an engine fault, without Ray or a model (``raymoe.client.request_resume``): a fake
executor stands in for the ranks (``test_supervision``). A request submitted with the tokens it delivered goes on
from there (its rows carry only the new tokens, its seeded draws continue at its position, ``max_tokens`` counts
from the start); a rank fault mid-stream then costs the streams a pause and no token; the bounds on resuming hold;
the idle invariant holds afterwards."""

from __future__ import annotations

import pytest
from idle import assert_idle
from test_supervision import Collector, FakeExecutor, adds, expected_tokens, make_driver, prompt_of, run_all, wait_until

from raymoe.actors.driver_service import AddRequest, DriverService, RequestDelta
from raymoe.actors.executor import RankFailure
from raymoe.actors.records import RequestError
from raymoe.client.request_resume import ResumableRequest
from raymoe.config import FaultConfig
from raymoe.errors import InvalidRequestError
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.sampling_table import SamplingTable


def test_a_resumed_request_streams_only_the_tokens_after_those_it_carries():
    want = expected_tokens(prompt_of(5), 12)
    driver = make_driver(dp=2)
    driver.record_outputs = True
    assert driver.submit("r", prompt_of(5), SamplingParams(max_tokens=12, temperature=0), output_ids=want[:5])
    run_all(driver)
    rows = list(driver.take_outputs())
    assert [t for d in rows for t in d.token_ids] == want[5:]
    assert rows[-1].finish_reason == "length" and rows[-1].completion_tokens == 12
    assert rows[-1].prompt_tokens == len(prompt_of(5))
    assert driver.idle_report().leaked_kv_slots == 0


def test_a_resumed_seeded_request_draws_at_its_own_position():
    """Seeded sampling draws from ``(seed, tokens generated so far)`` (``raymoe.runner.sampler``): the first step
    of a request resumed after k tokens carries output length k, as its undisturbed run's k-th step does."""
    driver = make_driver(dp=1)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    driver.submit("r", prompt_of(1), params, output_ids=[5, 6, 7])
    batch = driver.groups[0].scheduler.get_next_batch_to_run()
    sampling = SamplingTable().resolve(batch.worker_batch)  # as the ranks assemble it
    assert sampling.output_lens == [3]
    assert sampling.seeds == [7]


@pytest.mark.parametrize("output_ids", [[4] * 12, [4] * 130, [100]])
def test_a_resume_that_cannot_go_on_is_refused_naming_output_ids(output_ids):
    """Already at ``max_tokens`` (12), past the context (128 tokens), or an id outside the vocabulary (100)."""
    group = make_driver(dp=1).groups[0]
    params = SamplingParams(max_tokens=12 if len(output_ids) < 100 else 200, temperature=0)
    with pytest.raises(InvalidRequestError) as e:
        group.add("r", prompt_of(1), params, report=False, output_ids=output_ids)
    assert e.value.field == "output_ids"
    assert group.scheduler.idle_report() is not None


class FrontEnd:
    """What ``EngineClient.generate`` does with a service's rows: deliver tokens, resume on an ``"unhealthy"`` end
    once the service is healthy again (``ResumableRequest``), end on anything else."""

    def __init__(self, faults: FaultConfig):
        self.faults = faults
        self.reqs: dict[str, ResumableRequest] = {}
        self.errors: dict[str, RequestError] = {}
        self.pending: list[ResumableRequest] = []  # waiting for the engine to recover
        self.out = Collector()

    def __call__(self, batch) -> None:
        for d in batch:
            req = self.reqs[d.request_id]
            if d.error is not None:
                if req.may_resume(d.error, self.faults):
                    req.resumes += 1
                    self.pending.append(req)
                else:
                    self.errors[d.request_id] = d.error
                    self.out([d])
                continue
            req.delivered(d)
            self.out([d])

    def start(self, service: DriverService, batch: list[AddRequest]) -> None:
        for a in batch:
            self.reqs[a.request_id] = ResumableRequest(a.request_id, a.prompt_token_ids, a.params)
        service.submit(batch)

    def resume(self, service: DriverService) -> int:
        """Submit the requests waiting for recovery once ``service`` is healthy; returns how many."""
        if not self.pending or not service.healthy():
            return 0
        batch, self.pending = self.pending, []
        service.submit([r.add() for r in batch])
        return len(batch)


def ended(out: Collector, rids) -> bool:
    return all(out.last(r) is not None for r in rids)


@pytest.mark.parametrize("faults_in_a_row", [1, 2])
def test_a_rank_fault_mid_stream_costs_a_pause_and_no_token(faults_in_a_row):
    front = FrontEnd(FaultConfig(max_request_resumes=3))
    ex = FakeExecutor(delay_s=0.005)
    service = DriverService(make_driver(executor=ex), publish=front, supervise_interval_s=0.05)
    try:
        batch = adds("r", 6, max_tokens=40)
        front.start(service, batch)
        wait_until(lambda: all(len(front.reqs[a.request_id].output_ids) >= 3 for a in batch))
        resumed = 0
        for k in range(faults_in_a_row):  # the second fault hits the resumed requests on the new ranks
            ex.fail_next = [RankFailure(f"rank fault {k}")]
            wait_until(lambda: front.pending and service.healthy())
            resumed += front.resume(service)
        wait_until(lambda: front.resume(service) >= 0 and ended(front.out, front.reqs))
        assert not front.errors
        assert [front.out.tokens(f"r{i}") for i in range(6)] == [expected_tokens(prompt_of(i), 40) for i in range(6)]
        assert all(front.out.last(f"r{i}").completion_tokens == 40 for i in range(6))
        assert resumed >= 6 * faults_in_a_row and service.stats().rank_restarts == faults_in_a_row
        wait_until(lambda: service.stats().idle_checked)
        assert_idle(service)
    finally:
        service.shutdown()


def test_resumes_are_bounded_and_other_errors_are_final():
    params = SamplingParams(max_tokens=10, temperature=0)
    req = ResumableRequest("r", [1, 2], params)
    sick = RequestError("unhealthy", "a rank died")
    faults = FaultConfig(max_request_resumes=2)
    assert req.may_resume(sick, faults)
    req.resumes = 2
    assert not req.may_resume(sick, faults)
    req.resumes = 0
    assert not req.may_resume(RequestError("failed", "x"), faults)
    assert not req.may_resume(RequestError("invalid", "x", "prompt"), faults)
    assert not req.may_resume(sick, FaultConfig(max_request_resumes=0))
    req.delivered(RequestDelta("r", list(range(10))))
    assert not req.may_resume(sick, faults)  # nothing left to generate
    assert req.add().output_ids == tuple(range(10))
    with pytest.raises(InvalidRequestError):
        FaultConfig(max_request_resumes=-1)
    with pytest.raises(InvalidRequestError):
        FaultConfig(request_resume_timeout_s=0)


def test_a_retracted_request_resumes_without_using_up_its_fault_resumes():
    from raymoe.errors import EngineUnhealthyError

    params = SamplingParams(max_tokens=10, temperature=0)
    req = ResumableRequest("r", [1, 2], params, kv_received=True)
    retracted = RequestError("retracted", "the weights are being updated")
    assert isinstance(retracted.to_exception(), EngineUnhealthyError)
    faults = FaultConfig(max_request_resumes=0)
    assert req.may_resume(retracted, faults)  # a weight update is no fault: the bound does not apply
    assert req.add().kv_received
    req.retracts = 1
    assert not req.add().kv_received  # the KV it was sent went with the retraction: it re-prefills
    req.delivered(RequestDelta("r", list(range(10))))
    assert not req.may_resume(retracted, faults)  # nothing left to generate
    with pytest.raises(ValueError):
        RequestError("paused", "x")
