"""Scheduler paths the workload tests reach rarely or only by their effect on tokens: which step is formed next
(prefill first, MIXED steps and their budget, a prompt admitted in the step that ends the last request), how KV is
freed for decode (evict, retract the latest admitted request, retract the chunked request, finish the last one),
and the failure paths (a row that cannot be built, the steps in flight failing on the ranks), each checked on the
group's state right after the step that takes the path. Same fake rank as ``test_scheduler``."""

from __future__ import annotations

import logging

import pytest
from test_paged_kv import make_paged
from test_scheduler import FakeRank, assert_clean, drive, make, reference

from raymoe.config import CacheConfig, SchedulerConfig
from raymoe.errors import InvalidRequestError
from raymoe.scheduler.group_state import TokenRatioPolicy
from raymoe.scheduler.req import FinishKind, Req, RequestFault
from raymoe.scheduler.results import StopRules
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.scheduler import Scheduler
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_output import StepOutput, TokenLogprobs


def step(s: Scheduler, rank: FakeRank):
    """Form one step, run it on the fake rank and apply its tokens; returns the batch."""
    batch = s.get_next_batch_to_run()
    s.process_batch_result(batch, rank.step(batch.worker_batch))
    return batch


def shape(batch) -> tuple[ForwardMode, list[str]]:
    return batch.worker_batch.forward_mode, [r.rid for r in batch.reqs]


def finish_all(s: Scheduler, rank: FakeRank, specs) -> None:
    """Run the group to the end and check every request's tokens against the reference."""
    done = drive(s, {}, rank=rank)
    for rid, prompt, params in specs:
        assert done[rid].output_ids == reference(prompt, params, ctx=min(512, s.token_allocator.size + 1)), rid


# ------------------------------------------------------------------------------------------- batch formation
def test_a_new_prompt_is_prefilled_before_the_running_requests_decode():
    s = make()
    rank = FakeRank(s)
    s.add_request(Req("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    assert shape(step(s, rank)) == (ForwardMode.EXTEND, ["a"])
    s.add_request(Req("b", [4, 5], SamplingParams(max_tokens=8)))
    assert shape(step(s, rank)) == (ForwardMode.EXTEND, ["b"])
    assert shape(step(s, rank)) == (ForwardMode.DECODE, ["a", "b"])


def test_mixed_steps_carry_the_decodes_until_they_fill_the_step_budget():
    s = make(enable_mixed_chunk=True, chunked_prefill_size=None)
    rank = FakeRank(s)
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=30)))
    step(s, rank)
    s.add_request(Req("b", [3, 4, 5], SamplingParams(max_tokens=30)))
    assert shape(step(s, rank)) == (ForwardMode.MIXED, ["b", "a"])  # a new prompt and a decode row

    s = make(enable_mixed_chunk=True, chunked_prefill_size=3)
    rank = FakeRank(s)
    specs = [(f"r{i}", [i + 1], SamplingParams(max_tokens=20)) for i in range(3)] + \
        [("late", [7, 8], SamplingParams(max_tokens=5))]
    for spec in specs[:3]:
        s.add_request(Req(*spec))
    assert shape(step(s, rank)) == (ForwardMode.EXTEND, ["r0", "r1", "r2"])
    s.add_request(Req(*specs[3]))
    # three decode rows fill the 3-token budget: the prompt goes alone first, then everyone decodes
    assert shape(step(s, rank)) == (ForwardMode.EXTEND, ["late"])
    assert shape(step(s, rank)) == (ForwardMode.DECODE, ["r0", "r1", "r2", "late"])
    finish_all(s, rank, specs)


def test_mixed_step_evicts_just_enough_for_its_decodes_then_admits_the_prompt():
    """The decode rows' slot comes from evicting the oldest cached prefix; the prompt's from the next one, in the
    same MIXED step (it is not put off to a prefill of its own)."""
    s = make(max_total_tokens=64, enable_mixed_chunk=True, chunked_prefill_size=None)
    rank = FakeRank(s)
    drive(s, {0: [Req("x", [50], SamplingParams(max_tokens=1))]}, rank=rank)  # caches 1 token (the oldest)
    drive(s, {0: [Req("y", list(range(30, 40)), SamplingParams(max_tokens=1))]}, rank=rank)  # caches 10
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=8)))
    step(s, rank)
    stolen = s.token_allocator.alloc(s.token_allocator.available_size())
    s.add_request(Req("n", [3], SamplingParams(max_tokens=1)))
    batch = s.get_next_batch_to_run()
    assert shape(batch) == (ForwardMode.MIXED, ["n", "a"])
    s.process_batch_result(batch, rank.step(batch.worker_batch))
    s.token_allocator.free(stolen)
    finish_all(s, rank, [("a", [1, 2], SamplingParams(max_tokens=8))])


def test_the_step_that_ends_the_last_request_admits_a_waiting_prompt():
    """With a step in flight (no idle-pool eviction possible), decode finds no slot, finishes the last running
    request, and the prompt that was waiting for room is admitted in the same call."""
    s = make(max_total_tokens=16, chunked_prefill_size=None)
    rank = FakeRank(s)
    s.add_request(Req("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8)))
    step(s, rank)
    inflight = s.get_next_batch_to_run()  # a's decode, its result not applied yet
    stolen = s.token_allocator.alloc(s.token_allocator.available_size())
    s.add_request(Req("b", [7], SamplingParams(max_tokens=1)))
    batch = s.get_next_batch_to_run()
    assert shape(batch) == (ForwardMode.EXTEND, ["b"])
    (a,) = s.drain_finished()
    assert a.rid == "a" and a.finished_reason.kind == FinishKind.LENGTH
    assert s.process_batch_result(inflight, rank.step(inflight.worker_batch)) == []  # a's row is skipped
    s.process_batch_result(batch, rank.step(batch.worker_batch))
    s.token_allocator.free(stolen)
    assert_clean(s)


def test_an_idle_paged_pool_evicts_even_a_single_cached_token():
    s = make_paged(page=4, pool=16, chunked_prefill_size=None)
    drive(s, {0: [Req("w", [5], SamplingParams(max_tokens=1))]})
    assert s.tree_cache.total_size() == 1  # one token, whose page also strands 3 free slots
    prompt = list(range(1, 15))
    s.add_request(Req("b", prompt, SamplingParams(max_tokens=1)))
    batch = s.get_next_batch_to_run()
    assert shape(batch) == (ForwardMode.EXTEND, ["b"]) and s.tree_cache.total_size() == 0


def test_the_first_prompt_of_an_idle_pool_needs_room_for_its_tokens_only():
    """Idle, the pool admits a prompt that fits without its decode reservation, and keeps the cache (pages: the
    cached token strands 3 free slots, so prompt + reservation would not fit before the cache is dropped)."""
    s = make_paged(page=4, pool=16, chunked_prefill_size=None)
    drive(s, {0: [Req("w", [5], SamplingParams(max_tokens=1))]})
    s.add_request(Req("b", list(range(1, 11)), SamplingParams(max_tokens=10)))
    assert shape(s.get_next_batch_to_run()) == (ForwardMode.EXTEND, ["b"])
    assert s.tree_cache.total_size() == 1


def test_decode_rows_come_first_when_evicting_the_whole_cache_just_covers_them():
    """With no reservation (ratio 0), a prompt would fit in the one evictable slot; the MIXED step gives it to the
    running request's decode row instead, and the prompt waits."""
    s = Scheduler(SchedulerConfig(enable_mixed_chunk=True, chunked_prefill_size=None),
                  CacheConfig(max_total_tokens=64, max_context_len=512), eos_token_ids=(999,),
                  init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    rank = FakeRank(s)
    drive(s, {0: [Req("x", [50], SamplingParams(max_tokens=1))]}, rank=rank)  # caches 1 token
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=8)))
    step(s, rank)
    stolen = s.token_allocator.alloc(s.token_allocator.available_size())
    s.add_request(Req("n", [3], SamplingParams(max_tokens=1)))
    assert shape(s.get_next_batch_to_run()) == (ForwardMode.DECODE, ["a"])
    assert s.tree_cache.total_size() == 0 and s.token_allocator.available_size() == 0
    s.token_allocator.free(stolen)


def test_a_retracted_request_awaiting_its_token_in_flight_does_not_hold_up_the_queue():
    s = make()
    first, second = Req("first", [1, 2], SamplingParams(max_tokens=4)), Req("second", [3, 4], SamplingParams())
    s.add_request(first)
    s.add_request(second)
    first.pending_ids.append(-1)  # as after a retraction while the step in flight samples its next token
    assert shape(s.get_next_batch_to_run()) == (ForwardMode.EXTEND, ["second"])
    assert s.state.waiting == [first]


def test_hit_tokens_count_each_admissions_cached_prompt_tokens_once():
    s = make(chunked_prefill_size=4)  # prompts in several chunks: continuing a chunk is no new admission
    shared = list(range(1, 13))
    specs = [(f"r{i}", shared + [20 + i], SamplingParams(max_tokens=3)) for i in range(4)]
    done = drive(s, {10 * i: [Req(*spec)] for i, spec in enumerate(specs)})  # each arrives once the last finished
    cached = [done[rid].cached_tokens for rid, _, _ in specs]
    assert cached == [0, 12, 12, 12]
    assert s.state.hit_tokens == sum(cached) == s.tree_cache.hit_tokens


def test_new_token_ratio_decays_per_decode_step_down_to_its_floor():
    s = Scheduler(SchedulerConfig(enable_mixed_chunk=False), CacheConfig(max_total_tokens=256, max_context_len=128),
                  eos_token_ids=(999,), init_new_token_ratio=0.5, min_new_token_ratio=0.4, new_token_ratio_decay=0.03)
    rank = FakeRank(s)
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=10)))
    step(s, rank)
    assert s.state.new_token_ratio == 0.5  # a prefill step does not decay it
    ratios = [(step(s, rank), s.state.new_token_ratio)[1] for _ in range(5)]
    assert ratios == pytest.approx([0.47, 0.44, 0.41, 0.4, 0.4])


def test_an_idle_pool_admits_a_prompt_whose_reservation_does_not_fit():
    """Alone in the pool, a request needs room for its prompt only (its output may be cut by LENGTH)."""
    s = Scheduler(SchedulerConfig(enable_mixed_chunk=False, chunked_prefill_size=None),
                  CacheConfig(max_total_tokens=32, max_context_len=512), eos_token_ids=(999,),
                  init_new_token_ratio=1.0)
    prompt, params = list(range(20)), SamplingParams(max_tokens=30)
    done = drive(s, {0: [Req("a", prompt, params)]})
    assert done["a"].output_ids == reference(prompt, params, ctx=33)


# ------------------------------------------------------------------------------------------------ retraction
def test_decode_evicts_then_retracts_the_latest_admitted_request():
    s = make(max_total_tokens=64, chunked_prefill_size=None)
    rank = FakeRank(s)
    drive(s, {0: [Req("w", [9], SamplingParams(max_tokens=1))]}, rank=rank)
    assert s.tree_cache.evictable_size() == 1
    specs = [("a", [1, 2], SamplingParams(max_tokens=12)), ("b", [3, 4], SamplingParams(max_tokens=12))]
    for spec in specs:
        s.add_request(Req(*spec))
    step(s, rank)
    b = s.state.running[1]
    for retractions in (1, 2):
        stolen = s.token_allocator.alloc(s.token_allocator.available_size())
        # two decode slots short: the one cached token is not enough, so b (admitted last) goes back to waiting
        assert shape(step(s, rank)) == (ForwardMode.DECODE, ["a"])
        assert s.state.waiting == [b] and b.req_pool_idx is None and b.kv_slots == []
        assert s.tree_cache.total_size() == 0  # evicted, and a retracted request caches nothing
        assert (b.num_retractions, s.state.num_retractions) == (retractions, retractions)
        assert s.state.new_token_ratio == pytest.approx(1.0 - s.state.ratio.decay)  # reset, then one decode
        s.token_allocator.free(stolen)
        while b not in s.state.running:
            step(s, rank)
    finish_all(s, rank, specs)


def test_decode_retracts_the_chunked_request_when_one_request_runs():
    s = make(max_total_tokens=40, chunked_prefill_size=4)
    rank = FakeRank(s)
    specs = [("a", [1, 2], SamplingParams(max_tokens=6)), ("c", list(range(3, 15)), SamplingParams(max_tokens=2))]
    s.add_request(Req(*specs[0]))
    step(s, rank)
    s.add_request(Req(*specs[1]))
    assert shape(step(s, rank)) == (ForwardMode.EXTEND, ["c"]) and s.state.chunked_req.rid == "c"
    c = s.state.chunked_req
    stolen = s.token_allocator.alloc(s.token_allocator.available_size())
    assert shape(step(s, rank)) == (ForwardMode.DECODE, ["a"])
    assert s.state.chunked_req is None and s.state.waiting == [c] and c.req_pool_idx is None
    assert (c.num_retractions, s.state.num_retractions) == (1, 1)
    s.token_allocator.free(stolen)
    finish_all(s, rank, specs)


# --------------------------------------------------------------------------------------------- failure paths
def test_a_request_whose_row_cannot_be_built_fails_alone(caplog):
    s = make()
    rank = FakeRank(s)
    specs = [(rid, [i + 1, i + 2], SamplingParams(max_tokens=4)) for i, rid in enumerate(["x", "y", "z"])]
    reqs = [Req(*spec) for spec in specs]
    for r in reqs:
        s.add_request(r)
    object.__setattr__(reqs[1].sampling_params, "temperature", -1.0)  # changed after it was checked
    with caplog.at_level(logging.WARNING, logger="raymoe.scheduler.group_state"):
        batch = s.get_next_batch_to_run()
    assert shape(batch) == (ForwardMode.EXTEND, ["x", "z"])
    (bad,) = s.drain_finished()
    assert bad is reqs[1] and bad.finished_reason.kind == FinishKind.ERROR and bad.req_pool_idx is None
    assert (bad.finished_reason.fault.kind, bad.finished_reason.fault.field) == ("invalid", "temperature")
    assert [r.getMessage() for r in caplog.records] == [f"request y failed: {bad.finished_reason.message}"]
    assert s.tree_cache.total_size() == 0  # its KV was never computed: nothing of it is cached
    s.process_batch_result(batch, rank.step(batch.worker_batch))
    finish_all(s, rank, [specs[0], specs[2]])


def test_failing_the_steps_in_flight_fails_each_request_once_and_drops_the_cache():
    s = make(chunked_prefill_size=None)
    drive(s, {0: [Req("warm", [1, 2, 3, 4], SamplingParams(max_tokens=3))]})
    cached = s.tree_cache.total_size()
    assert cached > 0
    s.add_request(Req("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=9)))  # locks the cached prefix
    s.add_request(Req("b", [7, 8], SamplingParams(max_tokens=9)))
    first, second = s.get_next_batch_to_run(), s.get_next_batch_to_run()  # overlap: both in flight
    assert [r.rid for r in first.reqs] == [r.rid for r in second.reqs] == ["a", "b"]
    fault = RequestFault("failed", "a rank died")
    failed = s.fail_inflight(fault)
    assert [r.rid for r in failed] == ["a", "b"]
    for r in failed:
        assert r.finished_reason.kind == FinishKind.ERROR and r.finished_reason.fault is fault
    assert s.drain_finished() == []  # the caller reports them
    assert not s.state.inflight and s.tree_cache.total_size() == 0  # the cached prefixes went too
    assert_clean(s)
    # nothing in flight: nothing fails and the cache stays
    drive(s, {0: [Req("c", [1, 2, 3], SamplingParams(max_tokens=2))]}, rank=FakeRank(s))
    kept = s.tree_cache.total_size()
    assert kept > 0 and s.fail_inflight(fault) == [] and s.tree_cache.total_size() == kept


def test_a_finished_request_in_a_failed_step_is_not_failed_again():
    s = make(chunked_prefill_size=None)
    rank = FakeRank(s)
    s.add_request(Req("short", [1, 2], SamplingParams(max_tokens=1)))
    s.add_request(Req("long", [3, 4], SamplingParams(max_tokens=9)))
    first = s.get_next_batch_to_run()
    second = s.get_next_batch_to_run()
    (short, long_) = first.reqs
    s.process_batch_result(first, rank.step(first.worker_batch))
    assert short.finished and [r.rid for r in second.reqs] == ["long"]
    assert s.fail_inflight(RequestFault("failed", "a rank died")) == [long_]
    assert short.finished_reason.kind == FinishKind.LENGTH
    assert_clean(s)


# --------------------------------------------------------------------------------------------------- intake
def test_refusals_name_their_field_and_reason():
    s = Scheduler(SchedulerConfig(max_queued_requests=2), CacheConfig(max_total_tokens=64, max_context_len=32),
                  eos_token_ids=(999,), vocab_size=8)

    def refused(req: Req) -> tuple[str, str]:
        with pytest.raises(InvalidRequestError) as e:
            s.add_request(req)
        return e.value.field, e.value.message

    assert refused(Req("lp", [1], SamplingParams(logprobs=9))) == ("logprobs", "must be <= the vocabulary size 8")
    assert refused(Req("st", [1], SamplingParams(stop=("x",)))) == \
        ("stop", "stop strings need a detokenizer, and this scheduler has none")
    s.add_request(Req("e", [1], SamplingParams()))
    assert refused(Req("e", [2], SamplingParams())) == ("rid", "a request with id 'e' is already in progress")
    aborted = s.abort_request("e")
    assert aborted.finished_reason.kind == FinishKind.ABORT and aborted.finished_reason.message == "aborted"
    assert refused(aborted) == ("rid", "request 'e' was already scheduled")  # finished, holds nothing
    used = Req("u", [1], SamplingParams())
    used.kv_slots.append(3)
    assert refused(used) == ("rid", "request 'u' was already scheduled")  # holds KV
    done = Req("m", [1], SamplingParams(max_tokens=1), output_ids=[3])  # resumed with nothing left to generate
    assert refused(done) == ("output_ids", "1 tokens were generated already, max_tokens is 1")
    s.add_request(Req("f", [1], SamplingParams()))
    s.add_request(Req("g", [1], SamplingParams()))
    assert refused(Req("h", [1], SamplingParams())) == ("queue", "2 requests are already waiting")


# ------------------------------------------------------------------------------------ group state and results
def test_token_ratio_policy_bounds():
    for init, floor in ((1.0, 0.0), (0.5, 0.5), (0.0, 0.0)):
        TokenRatioPolicy(init, floor)
    for init, floor in ((1.5, 0.1), (0.5, 0.6), (0.5, -0.1)):
        with pytest.raises(ValueError, match="^need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1$"):
            TokenRatioPolicy(init, floor)
    with pytest.raises(TypeError, match="^detokenize must be callable or None, got int$"):
        StopRules(frozenset(), detokenize=5)


@pytest.mark.parametrize(("prompt_len", "admitted"), [(15, True), (16, False)])
def test_admission_reserves_a_running_requests_decodes_up_to_the_longest_sequence(prompt_len, admitted):
    """Pool 32: the longest sequence is 33 tokens, whose KV holds 32. Running ``a`` (2 of those computed) reserves
    half (ratio 0.5) of its remaining 30, so 15 of the 30 free slots are left for a one-token request."""
    s = Scheduler(SchedulerConfig(enable_mixed_chunk=False), CacheConfig(max_total_tokens=32, max_context_len=512),
                  eos_token_ids=(999,), init_new_token_ratio=0.5)
    rank = FakeRank(s)
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=100)))
    step(s, rank)
    s.add_request(Req("b", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=1)))
    assert shape(s.get_next_batch_to_run()) == ((ForwardMode.EXTEND, ["b"]) if admitted else
                                                (ForwardMode.DECODE, ["a"]))


def test_a_full_ratio_reservation_keeps_the_pool_for_the_running_request():
    s = Scheduler(SchedulerConfig(enable_mixed_chunk=False), CacheConfig(max_total_tokens=32, max_context_len=512),
                  eos_token_ids=(999,), init_new_token_ratio=1.0)
    rank = FakeRank(s)
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=100)))
    step(s, rank)
    s.add_request(Req("b", [5], SamplingParams(max_tokens=1)))
    assert shape(s.get_next_batch_to_run()) == (ForwardMode.DECODE, ["a"])  # a may grow to all 32 slots


def test_disabled_radix_cache_and_aborted_requests_cache_nothing():
    s = make(radix=False)
    drive(s, {0: [Req("a", [1, 2, 3], SamplingParams(max_tokens=3))]})
    assert s.tree_cache.total_size() == 0
    again = drive(s, {0: [Req("b", [1, 2, 3], SamplingParams(max_tokens=3))]})["b"]
    assert again.cached_tokens == 0 and s.state.hit_tokens == 0 and s.state.num_retractions == 0

    s = make()
    rank = FakeRank(s)
    s.add_request(Req("c", [1, 2, 3], SamplingParams(max_tokens=9)))
    step(s, rank)
    step(s, rank)
    s.abort_request("c")
    assert s.tree_cache.total_size() == 0
    assert_clean(s)


def test_release_caches_only_the_real_tokens_and_frees_the_slots_of_a_step_in_flight():
    s = make()
    rank = FakeRank(s)
    req = Req("a", [1, 2, 3], SamplingParams(max_tokens=9))
    s.add_request(req)
    step(s, rank)
    s.get_next_batch_to_run()
    s.get_next_batch_to_run()  # formed before the previous step's token is known: one slot past the real tokens
    assert len(req.kv_slots) == len(req.fill_ids) + 1
    s.state.running.remove(req)
    s.state.release(req, cache=True)
    assert s.tree_cache.total_size() == 4 == len(req.fill_ids)
    assert s.token_allocator.available_size() + s.tree_cache.total_size() == s.token_allocator.size


def test_a_request_whose_stop_check_raises_fails_alone(caplog):
    def detokenize(ids):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "bad byte")

    s = make(detokenize=detokenize)
    rank = FakeRank(s)
    specs = [("bad", [1, 2], SamplingParams(max_tokens=5, stop=("zz",))), ("ok", [3, 4], SamplingParams(max_tokens=5))]
    for spec in specs:
        s.add_request(Req(*spec))
    batch = s.get_next_batch_to_run()
    with caplog.at_level(logging.ERROR, logger="raymoe.scheduler.results"):
        out = s.process_batch_result(batch, rank.step(batch.worker_batch))
    assert [r.rid for r in out] == ["bad", "ok"]
    bad, ok = out
    assert bad.finished_reason.kind == FinishKind.ERROR and bad.req_pool_idx is None
    assert (bad.finished_reason.fault.kind, bad.finished_reason.message) == \
        ("failed", "checking the request's stop conditions failed (UnicodeDecodeError)")
    assert [r.getMessage() for r in caplog.records] == ["post-processing request bad failed"]
    assert caplog.records[0].exc_info is not None
    assert not ok.finished and len(ok.output_ids) == 1 and s.drain_finished() == []
    finish_all(s, rank, specs[1:])


def test_results_keep_each_tokens_logprobs_and_check_the_batch():
    s = make()
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=5, logprobs=1)))
    batch = s.get_next_batch_to_run()
    lp = TokenLogprobs(-0.5, [7], [-0.5])
    with pytest.raises(ValueError, match="^StepOutput has 2 tokens for 1 requests$"):
        s.process_batch_result(batch, StepOutput(next_token_ids=[7, 8]))
    later = s.get_next_batch_to_run()
    with pytest.raises(ValueError, match="^process_batch_result: this batch is not the oldest one in flight$"):
        s.process_batch_result(later, StepOutput(next_token_ids=[7]))
    (req,) = s.process_batch_result(batch, StepOutput(next_token_ids=[7], logprobs=[lp]))
    assert req.output_ids == [7] and req.output_logprobs == [lp]
