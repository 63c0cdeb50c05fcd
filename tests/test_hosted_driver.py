"""The hosted driver (each DP group's scheduler in a process of its own), without Ray: its group servers run behind
pickling loopback links (``raymoe.actors.loopback_groups``), each with its own fake ranks.

Checked: every request gets its own tokens, exactly one last row, and its KV back, with overlap scheduling on and
off and requests arriving and aborted at random steps; every step's shared decisions agree across groups (the
checks of ``tests/step_decisions.py`` on the batches each group's ranks received); the driver's messages stay the
same size whatever the number of running requests; and the fault scopes of the in-process driver hold: a step a
rank raised in fails only its requests, a second one in a row or a lost group restarts the ranks (through the
``DriverService``), an error in a group's own code fails the in-flight requests and the loop goes on."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from step_decisions import check_step_decisions
from test_driver_agreement import CheckingRanks, workloads
from test_supervision import EOS, VOCAB, FakeExecutor, detokenize, expected_tokens, wait_until

from raymoe.actors.driver_service import AddRequest, DriverService
from raymoe.actors.executor import RankFailure, RankStepError
from raymoe.actors.group_scheduler import GroupScheduler
from raymoe.actors.hosted_driver import HostedDriver
from raymoe.actors.loopback_groups import LoopbackGroups
from raymoe.actors.output_batch import OutputBatch
from raymoe.config import CacheConfig, EngineConfig, SchedulerConfig
from raymoe.runner.graph_buckets import capture_sizes
from raymoe.scheduler.sampling_params import SamplingParams


def config_of(overlap: bool = True, max_running: int = 8, kv_tokens: int = 512) -> EngineConfig:
    return EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=kv_tokens, max_context_len=128),
                        scheduler=SchedulerConfig(max_running_requests=max_running, chunked_prefill_size=None,
                                                  disable_overlap_schedule=not overlap))


def hosted(dp: int, config: EngineConfig | None = None, make_ranks=None) -> tuple[HostedDriver, OutputBatch]:
    """A hosted driver over ``dp`` loopback groups; returns it and the rows the groups published."""
    config = config or config_of()
    rows = OutputBatch()
    groups = LoopbackGroups(config, [EOS], detokenize, VOCAB, make_ranks or (lambda d: FakeExecutor()),
                            rows.extend, dp)
    return HostedDriver(config, groups, dp, vocab_size=VOCAB), rows


def by_request(rows: OutputBatch) -> tuple[dict, dict]:
    """Tokens and last rows per request id (asserting one last row each)."""
    tokens, ends = {}, {}
    for d in rows:
        assert d.request_id not in ends, f"{d.request_id} got a row after its last one"
        tokens.setdefault(d.request_id, []).extend(d.token_ids)
        if d.finished:
            ends[d.request_id] = d
    return tokens, ends


def run(driver: HostedDriver, limit: int = 500) -> None:
    for _ in range(limit):
        if not driver.has_unfinished():
            return
        driver.step()
    raise AssertionError("the hosted driver made no progress")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp=st.integers(1, 3), overlap=st.booleans(), arrivals=st.lists(
    st.tuples(st.integers(0, 30), st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12), st.integers(1, 20),
              st.one_of(st.none(), st.integers(0, 30))), min_size=1, max_size=20))
def test_every_request_gets_its_own_tokens_one_last_row_and_its_kv_back(dp, overlap, arrivals):
    driver, rows = hosted(dp, config_of(overlap))
    events = sorted([(t, "add", f"r{i}", p, n) for i, (t, p, n, _) in enumerate(arrivals)]
                    + [(t + a, "abort", f"r{i}") for i, (t, _, _, a) in enumerate(arrivals) if a is not None],
                    key=lambda e: (e[0], e[1] != "add"))
    for step in range(600):
        while events and events[0][0] <= step:
            _, kind, rid, *rest = events.pop(0)
            if kind == "add":
                driver.submit(rid, rest[0], SamplingParams(max_tokens=rest[1], temperature=0.0))
            else:
                driver.abort_request(rid)
        if not events and not driver.has_unfinished():
            break
        if driver.has_unfinished():
            driver.step()
        rows.extend(driver.take_outputs())  # rows the driver wrote itself (an abort before the group saw it)
    rows.extend(driver.take_outputs())
    assert not driver.has_unfinished()
    tokens, ends = by_request(rows)
    assert set(ends) == {f"r{i}" for i in range(len(arrivals))}
    for i, (_, prompt, n, _) in enumerate(arrivals):
        end, want = ends[f"r{i}"], expected_tokens(prompt, n)
        if end.finish_reason == "abort":
            assert tokens.get(f"r{i}", []) == want[:len(tokens.get(f"r{i}", []))]
        else:
            assert (end.finish_reason, tokens[f"r{i}"]) == ("length", want)
    assert driver.group_of == {}
    report = driver.idle_report()
    assert report is not None and report.clean


class RecordingRanks(CheckingRanks):
    """One group's fake ranks: the token rule of ``CheckingRanks``, and every batch kept (``log``) so that the
    test can check each step across the groups."""

    def launch(self, batches):
        self.steps += 1
        self.log.append(batches[0])
        b = batches[0]
        return [[EOS if self.eos_every and (self.steps * 7 + i * 3) % self.eos_every == 0
                 else 1 + (self.steps + i) % (VOCAB - 1) for i in range(b.batch_size)]]

    def collect(self, handle):
        from raymoe.step.step_output import StepOutput

        return [StepOutput(handle[0])]


@settings(max_examples=120, deadline=None, derandomize=False, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(dp=None))
def test_every_step_the_groups_send_their_ranks_carries_the_same_decisions(w):
    config, dp = w["config"], w["dp"]
    graph = config.graph
    sizes = () if graph.disable_cuda_graph else tuple(
        capture_sizes(config.scheduler.max_running_requests, graph.cuda_graph_bs, graph.cuda_graph_max_bs))
    ranks = [RecordingRanks(config, dp, sizes, w["eos_every"]) for _ in range(dp)]
    groups = LoopbackGroups(config, [EOS], lambda ids: "", VOCAB, lambda d: ranks[d], lambda rows: None, dp)
    driver = HostedDriver(config, groups, dp, graph_capture_sizes=sizes, vocab_size=VOCAB)
    events, last = list(w["events"]), max((e[0] for e in w["events"]), default=0)
    for step in range(2000):
        while events and events[0][0] == step:
            _, kind, rid, *rest = events.pop(0)
            if kind == "abort":
                driver.abort_request(rid)
            elif rid not in driver.group_of:
                driver.submit(rid, rest[0], SamplingParams(max_tokens=rest[1], temperature=0.0))
        if step > last and not driver.has_unfinished():
            break
        driver.step()
    assert not driver.has_unfinished(), "the hosted driver made no progress"
    assert len({len(r.log) for r in ranks}) == 1, "a group's ranks missed a step"
    for step_batches in zip(*(r.log for r in ranks), strict=True):
        check_step_decisions(list(step_batches), dp, config.overlap, sizes, config.moe_comm.a2a_mode,
                             config.max_dispatch_tokens_per_rank)
    report = driver.idle_report()
    assert report is not None and report.clean


def test_the_drivers_messages_do_not_grow_with_the_running_requests():
    """Per decode step the driver sends and receives a few hundred bytes per group, whether 4 or 64 requests run
    (token ids and rows go from the groups to the front end)."""
    sizes = {}
    for running in (4, 64):
        driver, _ = hosted(2, config_of(max_running=running, kv_tokens=running * 128))
        for i in range(2 * running):
            driver.submit(f"r{i}", [1 + i % 50, 2], SamplingParams(max_tokens=100, temperature=0.0))
        for _ in range(20):  # every request admitted and decoding
            driver.step()
        links = driver.executor.links
        before = [(link.bytes_in, link.bytes_out) for link in links]
        for _ in range(10):
            driver.step()
        sizes[running] = [((a - b) / 10, (c - d) / 10) for (a, c), (b, d) in
                          zip([(link.bytes_in, link.bytes_out) for link in links], before, strict=True)]
        assert sum(s.num_running for s in driver.group_stats()) == 2 * running
    for (cmd4, reply4), (cmd64, reply64) in zip(sizes[4], sizes[64], strict=True):
        assert cmd4 == cmd64 and cmd64 < 400, sizes
        assert reply64 <= reply4 + 16 and reply64 < 600, sizes  # counters may take a byte or two more


def test_a_step_a_rank_raised_in_fails_that_steps_requests_only():
    """The in-flight requests of every group fail (as with the in-process driver); the waiting ones run after."""
    executors = [FakeExecutor(), FakeExecutor()]
    driver, rows = hosted(2, config_of(max_running=2), make_ranks=lambda d: executors[d])
    for i in range(8):
        driver.submit(f"r{i}", [3 + i, 5], SamplingParams(max_tokens=6, temperature=0.0))
    for _ in range(3):
        driver.step()
    executors[1].fail_next.append(RankStepError("boom"))
    run(driver)
    tokens, ends = by_request(rows)
    failed = [r for r, d in ends.items() if d.error is not None]
    assert failed and all(ends[r].error.kind == "failed" for r in failed)
    assert len(failed) <= 4 and len(ends) == 8 and driver.num_failed_steps == 1
    for r in set(ends) - set(failed):
        assert tokens[r] == expected_tokens([3 + int(r[1:]), 5], 6)
    driver.submit("after", [9, 9], SamplingParams(max_tokens=3, temperature=0.0))
    run(driver)
    assert by_request(rows)[0]["after"] == expected_tokens([9, 9], 3)
    assert driver.idle_report().clean


def test_a_second_failed_step_in_a_row_is_a_rank_fault():
    executors = [FakeExecutor(), FakeExecutor()]
    driver, rows = hosted(2, make_ranks=lambda d: executors[d])
    driver.submit("a", [3, 5], SamplingParams(max_tokens=6, temperature=0.0))
    executors[0].fail_next.append(RankStepError("boom"))
    run(driver)
    assert driver.num_failed_steps == 1 and by_request(rows)[1]["a"].error.kind == "failed"
    driver.submit("b", [3, 6], SamplingParams(max_tokens=6, temperature=0.0))
    executors[0].fail_next.append(RankStepError("boom again"))
    with pytest.raises(RankFailure, match="2 failed step"):
        run(driver)


def test_a_rank_fault_restarts_ranks_and_groups_and_the_engine_serves_again():
    executors: list[FakeExecutor] = []

    def make(d):
        executors.append(FakeExecutor())
        return executors[-1]

    driver, rows = hosted(2, make_ranks=make)
    out = OutputBatch()
    service = DriverService(driver, out.extend, restart_backoff_s=0.1)
    try:
        service.submit([AddRequest(f"r{i}", [3 + i, 4], SamplingParams(max_tokens=50, temperature=0.0))
                        for i in range(4)])
        wait_until(lambda: driver.num_steps >= 3)
        executors[1].fail_next.append(RankFailure("a rank died"))
        wait_until(lambda: service.rank_restarts == 1)
        wait_until(lambda: service.healthy())
        service.submit([AddRequest("after", [7, 7], SamplingParams(max_tokens=3, temperature=0.0))])
        wait_until(lambda: "after" in rows.ended_ids())
    finally:
        service.shutdown()
    everything = OutputBatch()
    everything.extend(rows)
    everything.extend(out)
    tokens, ends = by_request(everything)
    assert {r for r in ends if r.startswith("r")} == {f"r{i}" for i in range(4)}
    assert all(ends[f"r{i}"].error is not None for i in range(4))
    assert tokens["after"] == expected_tokens([7, 7], 3)
    assert driver.executor.restarts == 1


def test_a_lost_group_is_a_rank_fault_and_the_driver_ends_its_requests():
    driver, rows = hosted(2)
    for i in range(4):
        driver.submit(f"r{i}", [3 + i, 4], SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(3):
        driver.step()
    lost = driver.executor.links[1]

    def gone(timeout_s):
        raise RankFailure("DP group 1's scheduler went away (EOFError)")

    lost.recv = gone
    with pytest.raises(RankFailure, match="group 1"):
        driver.step()
    from raymoe.actors.records import RequestError

    own = driver.end_all(RequestError("unhealthy", "restarting"))
    ended_here = {own.rids[row] for row in own.ends}
    assert ended_here == {r for r, g in driver.group_of.items() if g == 1} and ended_here
    driver.executor.restart()
    driver.reset()
    assert driver.group_of == {} and not driver.has_unfinished()


def test_an_error_in_a_groups_own_code_fails_in_flight_requests_and_the_loop_goes_on(monkeypatch):
    driver, rows = hosted(2)
    out = OutputBatch()
    service = DriverService(driver, out.extend)
    real = GroupScheduler.finish
    calls = {"n": 0}

    def flaky(self, output):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyError("a bug in a group")
        return real(self, output)

    monkeypatch.setattr(GroupScheduler, "finish", flaky)
    try:
        service.submit([AddRequest(f"r{i}", [3 + i, 4], SamplingParams(max_tokens=20, temperature=0.0))
                        for i in range(4)])
        wait_until(lambda: not driver.has_unfinished() and len(out.ends) + len(rows.ends) >= 4)
        service.submit([AddRequest("after", [7, 7], SamplingParams(max_tokens=3, temperature=0.0))])
        wait_until(lambda: "after" in rows.ended_ids())
    finally:
        service.shutdown()
    ends = [*out.ends.values(), *rows.ends.values()]
    assert any(e.error is not None and e.error.kind == "failed" for e in ends)
    assert rows.ended_ids().count("after") == 1 and driver.num_steps > 0


def test_an_abort_before_the_group_saw_the_request_ends_it_at_the_driver():
    driver, rows = hosted(2)
    driver.submit("a", [3, 4], SamplingParams(max_tokens=5, temperature=0.0))
    assert driver.abort_request("a") and not driver.abort_request("a")
    own = driver.take_outputs()
    assert own.ended_ids() == ["a"] and own.ends[0].finish_reason == "abort"
    assert not driver.has_unfinished() and driver.group_of == {}


def test_ranks_that_died_while_idle_are_a_rank_fault_at_the_first_launch():
    """With overlap scheduling the first step after an idle spell is launched without finishing one: a group whose
    ranks cannot take it (they died while idle) answers a rank failure there, which is the rank fault (before, the
    driver counted the step as in flight and the group's next finish found no step: an internal error that failed
    the requests without restarting the ranks)."""
    executors: list[FakeExecutor] = []

    class ClosedChannel(FakeExecutor):
        dead = False

        def launch(self, batches):
            if self.dead:
                raise RankFailure("the rank's step channel is closed")
            return super().launch(batches)

    def make(d):
        executors.append(ClosedChannel())
        return executors[-1]

    driver, _rows = hosted(2, make_ranks=make)
    driver.submit("a", [3, 4], SamplingParams(max_tokens=3, temperature=0.0))
    run(driver)
    for ex in executors:
        ex.dead = True
    driver.submit("b", [5, 6], SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(RankFailure, match="channel is closed"):
        for _ in range(3):
            driver.step()


def test_a_groups_rank_failure_is_read_at_once_while_another_group_still_computes():
    """``gather_replies`` over sockets: group 1 answers a rank failure at once while group 0's ranks would wait out
    a collective timeout for their dead peer; the exchange raises without waiting for group 0, whose link is then
    broken (its late reply would answer the wrong command)."""
    import pickle
    import threading
    import time
    from multiprocessing import Pipe

    from raymoe.actors.group_link import ConnectionLink, gather_replies
    from raymoe.actors.group_messages import GroupReply, GroupStats

    def group(conn, delay_s, failure):
        conn.recv_bytes()
        time.sleep(delay_s)
        try:
            conn.send_bytes(pickle.dumps(GroupReply(None, GroupStats(), rank_failure=failure)))
        except OSError:  # the driver's end is gone: it gave up on this late reply, as it should
            pass

    links = []
    for i, (delay, failure) in enumerate([(3.0, None), (0.0, "rank 1 died")]):
        ours, theirs = Pipe()
        threading.Thread(target=group, args=(theirs, delay, failure), daemon=True).start()
        links.append(ConnectionLink(ours, i))
        links[-1].send(b"step")
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died"):
        gather_replies(links, timeout_s=30.0)
    assert time.monotonic() - t0 < 2.0
    assert links[0].broken and not links[1].broken
    with pytest.raises(RankFailure, match="DP group 0"):
        links[0].send(b"next")
    # both answering in time: the replies in group order
    links = []
    for i in range(2):
        ours, theirs = Pipe()
        threading.Thread(target=group, args=(theirs, 0.2 * (1 - i), None), daemon=True).start()
        links.append(ConnectionLink(ours, i))
        links[-1].send(b"step")
    assert [r.rank_failure for r in gather_replies(links, timeout_s=30.0)] == [None, None]
    with pytest.raises(RankFailure, match="did not answer"):
        ours, theirs = Pipe()
        gather_replies([ConnectionLink(ours, 0)], timeout_s=0.2)
