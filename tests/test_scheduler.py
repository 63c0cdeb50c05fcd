"""Scheduler tests without a model: a fake rank keeps a simulated KV pool and ReqToTokenPool table, reads each
request's sequence back through the slots the batch names, and answers a deterministic function of it. So a
request's tokens are known in advance, whatever the batching, and any slot mix-up changes or breaks them.

The fake rank also resolves overlap-scheduling placeholders from its previous answer, as a real rank does
(``raymoe.runner.future_tokens``), and ``drive(..., overlap=True)`` forms step N+1 before it applies step N's
tokens, as the driver does. Most workloads run with overlap on and off and with MIXED batches on and off."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raymoe.config import CacheConfig, SchedulerConfig
from raymoe.errors import InvalidRequestError
from raymoe.scheduler.policy import order_waiting
from raymoe.scheduler.req import FinishKind, Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.scheduler import Scheduler
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_table import SamplingTable
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch

VOCAB = 64
NO_EOS = (999,)
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def next_token(seq: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    return (sum(seq) * 7 + len(seq) * 13 + seq[-1] * 3) % VOCAB


def detok(ids) -> str:
    return "".join(ALPHABET[t % 26] for t in ids)


def reference(prompt: list[int], params: SamplingParams, ctx: int = 10**9, eos=NO_EOS, model=next_token) -> list[int]:
    """Expected output of one request, straight from the definition (no scheduler)."""
    seq, out = list(prompt), []
    while True:
        t = model(seq)
        out.append(t)
        seq.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t in eos):
            return out
        if params.stop and any(s in detok(out) for s in params.stop):
            return out
        if len(out) >= params.max_tokens or len(seq) >= ctx:
            return out


class FakeRank:
    """Simulated rank: KV pool (slot -> (position, token)) and ReqToTokenPool table, both written as told.
    ``model``: the fake model (tokens -> next token). A TARGET_VERIFY row accepts its drafts while they equal the
    model's next tokens (greedy speculative decoding) and answers the model's token after them."""

    def __init__(self, sched: Scheduler, model=next_token):
        self.sched = sched
        self.model = model
        self.kv: dict[int, tuple[int, int]] = {}
        self.table: dict[int, dict[int, int]] = {}
        self.num_batches = 0
        self.max_extend_tokens = 0
        self.extend_lens_seen: list[int] = []
        self.modes_seen: list[ForwardMode] = []
        self.last_out: list[int] = []
        self.sampling = SamplingTable()

    def check_sampling(self, b: ModelWorkerBatch) -> None:
        """The sampling record this rank assembles from the rows it was sent once per admission equals each
        request's numbers, and every row that samples reads the index of the token it samples
        (tokens generated + placeholders of older steps still in flight)."""
        rec = self.sampling.resolve(b)
        inflight = list(self.sched.state.inflight)
        mine = next((k for k, sb in enumerate(inflight) if sb.worker_batch is b), None)
        if mine is None:  # a batch the test made itself
            return
        sb = inflight[mine]
        for i, (req, partial) in enumerate(zip(sb.reqs, sb.partial, strict=True)):
            p = req.sampling_params
            assert (rec.temperatures[i], rec.top_ps[i], rec.top_ks[i], rec.min_ps[i], rec.seeds[i],
                    rec.logprobs[i]) == (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.logprobs), req.rid
            if not partial and req.req_pool_idx == b.req_pool_indices[i]:
                older = sum(r is req and not q for ob in inflight[:mine]
                            for r, q in zip(ob.reqs, ob.partial, strict=True))
                drafts = b.draft_lens[i] if b.draft_lens else 0
                assert rec.output_lens[i] - drafts == len(req.output_ids) + older, req.rid

    def check_batch(self, b: ModelWorkerBatch) -> None:
        s = self.sched
        bs = b.batch_size
        assert b.forward_mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED,
                                  ForwardMode.TARGET_VERIFY) and bs > 0
        assert len(b.input_ids) == sum(b.extend_lens) == len(b.out_cache_loc)
        self.check_sampling(b)
        assert all(sl == p + e and e >= 1 for sl, p, e in zip(b.seq_lens, b.prefix_lens, b.extend_lens, strict=True))
        assert all(sl <= s.cache_config.max_context_len for sl in b.seq_lens)
        assert bs <= s.config.max_running_requests and s.num_running <= s.config.max_running_requests
        assert len(set(b.req_pool_indices)) == bs and all(0 <= r < s.req_pool_size for r in b.req_pool_indices)
        assert len(set(b.out_cache_loc)) == len(b.out_cache_loc)
        assert all(1 <= x <= s.cache_config.kv_pool_slots for x in b.out_cache_loc)
        if b.forward_mode == ForwardMode.DECODE:
            assert b.extend_lens == [1] * bs and b.prefix_slots == []
        else:
            held = b.table_lens or [0] * bs
            assert len(b.prefix_slots) == sum(b.prefix_lens) - sum(held)
            assert 0 not in b.prefix_slots and not set(b.prefix_slots) & set(b.out_cache_loc)
            n_dec = 0  # a MIXED batch ends with its decode rows (one token, prefix already on the rank)
            if b.forward_mode == ForwardMode.MIXED:
                drafts = b.draft_lens or (0,) * bs  # a decode row may verify drafts: 1 + k tokens
                while n_dec < bs and b.extend_lens[bs - 1 - n_dec] == 1 + drafts[bs - 1 - n_dec] and \
                        0 < held[bs - 1 - n_dec] == b.prefix_lens[bs - 1 - n_dec]:
                    n_dec += 1
                assert n_dec > 0  # (a one-token chunk continuation looks the same: a lower bound on prompts)
            limit = s.config.max_prefill_tokens
            if b.forward_mode == ForwardMode.TARGET_VERIFY:  # newest token + drafts, the prefix on the rank
                assert b.prefix_slots == [] and all(t == pre for t, pre in zip(held, b.prefix_lens, strict=True))
            elif s.config.chunked_prefill_size is not None:
                limit = min(limit, s.config.chunked_prefill_size)
                assert b.num_tokens <= limit + sum(b.draft_lens)
            elif bs - n_dec > 1:
                assert b.num_tokens <= limit

    def step(self, b: ModelWorkerBatch) -> StepOutput:
        self.check_batch(b)
        self.num_batches += 1
        self.modes_seen.append(b.forward_mode)
        if b.forward_mode.is_extend():
            self.max_extend_tokens = max(self.max_extend_tokens, b.num_tokens)
        # Placeholders -(i + 1): row i of the previous step's answer (only that step's rows are referenced).
        ids = [self.last_out[-t - 1] if t < 0 else t for t in b.input_ids]
        p = o = 0
        out, accepted = [], []
        held = b.table_lens or [0] * b.batch_size
        verify = b.forward_mode == ForwardMode.TARGET_VERIFY or any(b.draft_lens)
        draft_lens = b.draft_lens or [sl - pre - 1 if verify else 0 for pre, sl in zip(b.prefix_lens, b.seq_lens,
                                                                                          strict=True)]
        for row, pre, sl, tl, k in zip(b.req_pool_indices, b.prefix_lens, b.seq_lens, held, draft_lens,
                                       strict=True):
            table = self.table.setdefault(row, {})
            if b.forward_mode.is_extend():
                if sl - pre > 1 or b.forward_mode == ForwardMode.EXTEND:
                    self.extend_lens_seen.append(sl - pre)
                assert all(pos in table for pos in range(tl)), "table_len claims positions the table lacks"
                for pos in range(tl, pre):
                    table[pos] = b.prefix_slots[p + pos - tl]
                p += pre - tl
            for pos in range(pre, sl):
                slot = b.out_cache_loc[o]
                table[pos] = slot
                self.kv[slot] = (pos, ids[o])
                o += 1
            seq = []
            for pos in range(sl):
                kv_pos, tok = self.kv[table[pos]]
                assert kv_pos == pos, f"slot {table[pos]} holds position {kv_pos}, expected {pos}"
                seq.append(tok)
            if verify:  # the row's last k tokens are drafts, after its newest token at position sl - 1 - k
                last, a = sl - 1 - k, 0
                while a < k and self.model(seq[:last + 1 + a]) == seq[last + 1 + a]:
                    a += 1
                accepted.append(a)
                out.append(self.model(seq[:last + 1 + a]))
            else:
                out.append(self.model(seq))
        self.last_out = out
        return StepOutput(next_token_ids=out, accept_lens=tuple(accepted))


def make(max_total_tokens=4096, ctx=512, radix=True, eos=NO_EOS, detokenize=detok, page_size=None, speculative=None,
         **sched_kw) -> Scheduler:
    sched_kw.setdefault("enable_mixed_chunk", False)
    return Scheduler(SchedulerConfig(**sched_kw), CacheConfig(max_total_tokens=max_total_tokens, max_context_len=ctx,
                                                                enable_radix_cache=radix, page_size=page_size),
                     eos_token_ids=eos, detokenize=detokenize, speculative=speculative)


def live_slots(s: Scheduler) -> dict[int, set[int]]:
    live = list(s.running) + ([s.chunked_req] if s.chunked_req is not None else [])
    return {id(r): set(r.kv_slots) for r in live}


def drive(s: Scheduler, arrivals: dict[int, list[Req]], max_steps: int = 20000, aborts=None,
          rank: FakeRank | None = None, overlap: bool = False) -> dict[str, Req]:
    """Run the scheduler to completion, checking invariants every step. ``arrivals``: step -> requests to add.
    ``overlap``: form each step before applying the previous step's tokens (the driver's overlap scheduling; with
    speculation the driver's rule: the running step is applied first when the group may draft, which must hold
    whenever that step verifies drafts: checked)."""
    rank = rank or getattr(s, "rank", None) or FakeRank(s)
    finished: dict[str, Req] = {}
    aborts = aborts or {}
    inflight: deque = deque()

    def apply_oldest() -> None:
        for r in s.process_batch_result(*inflight.popleft()):
            if r.finished:
                finished[r.rid] = r
        s.check_memory_invariants()

    for step in range(max_steps):
        for r in arrivals.get(step, []):
            s.add_request(r)
        for rid in aborts.get(step, []):
            r = s.abort_request(rid)
            if r is not None:
                finished[rid] = r
        if not s.has_unfinished() and not inflight and step > max(arrivals, default=0):
            break
        if overlap and inflight and s.spec is not None and s.spec.wants_fresh_tokens():
            apply_oldest()
        if inflight:  # a step formed now would not see the accepted drafts of a verify step still running
            wb = inflight[-1][0].worker_batch
            assert wb.forward_mode != ForwardMode.TARGET_VERIFY and not any(wb.draft_lens), "formed over a verify"
        before = live_slots(s)
        batch = s.get_next_batch_to_run()
        for r in s.drain_finished():
            finished[r.rid] = r
        if batch is not None:
            # A request that lives on across scheduling keeps its slots; nobody else may get them.
            after = live_slots(s)
            new = set(batch.worker_batch.out_cache_loc)
            for key, slots in before.items():
                if key in after:
                    assert not slots & new, "a live request's slot was handed out again"
            inflight.append((batch, rank.step(batch.worker_batch)))  # ranks run steps in launch order
        elif not inflight:
            assert not s.has_unfinished(), "scheduler stalled with unfinished requests"
            continue
        if not overlap or len(inflight) == 2 or batch is None:
            apply_oldest()
    else:
        raise AssertionError("did not finish")
    assert_clean(s)
    s.rank = rank
    return finished


def assert_clean(s: Scheduler) -> None:
    s.check_memory_invariants()
    assert not s.has_unfinished() and s.num_running == 0 and s.num_waiting == 0
    free, stranded = s.token_allocator.available_size(), s.token_allocator.stranded_size()
    assert free + stranded == s.token_allocator.size - s.tree_cache.total_size()
    assert s.tree_cache.protected_size() == 0
    assert s.req_allocator.available_size() == s.req_allocator.size
    assert s.kv_usage() == 0.0


def stagger(specs, when) -> dict[int, list[Req]]:
    """Arrival plan: request ``i`` is added at step ``when(i)``."""
    plan: dict[int, list[Req]] = {}
    for i, spec in enumerate(specs):
        plan.setdefault(when(i), []).append(Req(*spec))
    return plan


def alone(prompt, params, ctx=512) -> list[int]:
    """Output of a request run by itself through a roomy scheduler."""
    s = make(ctx=ctx, chunked_prefill_size=None, max_prefill_tokens=10**6)
    return drive(s, {0: [Req("solo", prompt, params)]})["solo"].output_ids


def workload(n=12, shared=0, seed=0, max_tokens=(3, 25)):
    import random

    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(shared)]
    reqs = []
    for i in range(n):
        prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_tokens=rng.randrange(*max_tokens), temperature=0.0)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def check_against_reference(specs, finished, ctx=512):
    for rid, prompt, params in specs:
        r = finished[rid]
        want = reference(prompt, params, ctx=ctx)
        assert r.output_ids == want, rid
        assert r.finished_reason.kind == FinishKind.LENGTH
    # And the pure reference agrees with a one-request-at-a-time scheduler run.
    for rid, prompt, params in specs[:3]:
        assert alone(prompt, params, ctx=ctx) == finished[rid].output_ids


SCENARIOS = {
    "all_at_once": dict(sched=dict(), cache=dict()),
    "chunked_5": dict(sched=dict(chunked_prefill_size=5), cache=dict()),
    "tiny_budget_no_chunking": dict(sched=dict(chunked_prefill_size=None, max_prefill_tokens=8), cache=dict()),
    "few_rows": dict(sched=dict(max_running_requests=3), cache=dict()),
    "lpm": dict(sched=dict(schedule_policy="lpm", chunked_prefill_size=7), cache=dict()),
    "no_radix": dict(sched=dict(chunked_prefill_size=6), cache=dict(radix=False)),
}


MODES = pytest.mark.parametrize(("overlap", "mixed"), [(False, False), (True, False), (False, True), (True, True)],
                                ids=["plain", "overlap", "mixed", "overlap_mixed"])


@MODES
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_tokens_whatever_the_batching(name, overlap, mixed):
    sc = SCENARIOS[name]
    specs = workload(n=10, shared=6, seed=sum(map(ord, name)))
    s = make(**sc["cache"], **sc["sched"], enable_mixed_chunk=mixed)
    finished = drive(s, {0: [Req(*spec) for spec in specs]}, overlap=overlap)
    check_against_reference(specs, finished)
    if name == "chunked_5":
        assert s.rank.max_extend_tokens == 5


@MODES
def test_prefix_sharing_hits_cache(overlap, mixed):
    specs = workload(n=8, shared=24, seed=3)
    s = make(chunked_prefill_size=16, enable_mixed_chunk=mixed)
    # Staggered so that earlier requests finished (and were cached) when later ones arrive.
    finished = drive(s, stagger(specs, lambda i: 4 * i), overlap=overlap)
    check_against_reference(specs, finished)
    assert s.hit_tokens > 0 and s.tree_cache.hit_tokens > 0
    assert any(finished[rid].cached_tokens > 0 for rid, _, _ in specs)


@MODES
def test_small_pool_forces_retraction(overlap, mixed):
    specs = workload(n=10, shared=4, seed=5, max_tokens=(20, 40))
    s = make(max_total_tokens=70, chunked_prefill_size=8, enable_mixed_chunk=mixed)
    finished = drive(s, {0: [Req(*spec) for spec in specs]}, overlap=overlap)
    check_against_reference(specs, finished)
    assert s.num_retractions > 0
    assert any(finished[rid].num_retractions > 0 for rid, _, _ in specs)


@MODES
def test_requests_added_while_others_decode(overlap, mixed):
    specs = workload(n=12, shared=3, seed=9)
    s = make(chunked_prefill_size=6, max_running_requests=5, enable_mixed_chunk=mixed)
    finished = drive(s, stagger(specs, lambda i: 2 * i + (i % 3)), overlap=overlap)
    check_against_reference(specs, finished)
    assert (ForwardMode.MIXED in s.rank.modes_seen) == mixed


def test_fully_cached_prompt_still_computes_last_token():
    prompt = [5, 9, 1, 33, 2, 7]
    params = SamplingParams(max_tokens=4)
    s = make()
    first = drive(s, {0: [Req("a", prompt, params)]})["a"]
    # The first request cached prompt + 3 outputs; a second identical prompt matches all but its last token.
    second = drive(s, {0: [Req("b", prompt, params)]})["b"]
    assert second.output_ids == first.output_ids == reference(prompt, params)
    assert second.cached_tokens == len(prompt) - 1
    assert s.rank.extend_lens_seen == [len(prompt), 1]


def test_max_tokens_one_finishes_at_prefill():
    s = make(chunked_prefill_size=4)
    specs = [("a", list(range(1, 11)), SamplingParams(max_tokens=1)), ("b", [3, 4], SamplingParams(max_tokens=1))]
    finished = drive(s, {0: [Req(*x) for x in specs]})
    for rid, prompt, params in specs:
        assert finished[rid].output_ids == reference(prompt, params)
        assert finished[rid].finished_reason.kind == FinishKind.LENGTH
    assert s.rank.num_batches == 3  # 10 tokens in chunks of 4, "b" joins the last chunk


@pytest.mark.parametrize("overlap", [False, True])
def test_max_context_len_ends_with_length(overlap):
    prompt = list(range(10))
    params = SamplingParams(max_tokens=100)
    s = make(ctx=14)
    r = drive(s, {0: [Req("a", prompt, params)]}, overlap=overlap)["a"]
    assert len(r.output_ids) == 4 and r.output_ids == reference(prompt, params, ctx=14)
    assert r.finished_reason.kind == FinishKind.LENGTH


@pytest.mark.parametrize("overlap", [False, True])
def test_sequence_that_outgrows_the_pool_ends_with_length(overlap):
    s = make(max_total_tokens=10)
    prompt = list(range(8))
    r = drive(s, {0: [Req("a", prompt, SamplingParams(max_tokens=50))]}, overlap=overlap)["a"]
    # The KV of prompt + output minus the last token fills all 10 slots; one more token would need an 11th.
    assert len(r.output_ids) == 3 and r.output_ids == reference(prompt, SamplingParams(max_tokens=3))
    assert r.finished_reason.kind == FinishKind.LENGTH
    assert r.finished_reason.message == "the sequence outgrew the KV pool"


def test_last_request_without_a_slot_is_finished_not_hung():
    # Defensive path: take the free slots away behind the scheduler's back, as if a bug leaked them.
    s = make(max_total_tokens=12)
    s.add_request(Req("a", list(range(6)), SamplingParams(max_tokens=5)))
    rank = FakeRank(s)
    batch = s.get_next_batch_to_run()
    assert [r.rid for r in s.process_batch_result(batch, rank.step(batch.worker_batch))] == ["a"]
    stolen = s.token_allocator.alloc(s.token_allocator.available_size())
    assert s.get_next_batch_to_run() is None
    (r,) = s.drain_finished()
    assert r.rid == "a" and r.finished_reason.kind == FinishKind.LENGTH and len(r.output_ids) == 1
    assert r.finished_reason.message == "KV cache exhausted"
    assert s.tree_cache.total_size() == 6  # its prompt's KV is cached like any finished request's
    assert s.drain_finished() == []
    s.token_allocator.free(stolen)
    assert_clean(s)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_token_ids_eos_and_ignore_eos(overlap):
    prompt = [4, 8, 15, 16, 23, 42]
    full = reference(prompt, SamplingParams(max_tokens=12))
    stop_tok = full[4]
    k = full.index(stop_tok)
    s = make()
    got = drive(s, {0: [Req("st", prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_tok,)))]},
                overlap=overlap)["st"]
    assert got.output_ids == full[: k + 1]
    assert got.finished_reason.kind == FinishKind.STOP and got.finished_reason.matched == stop_tok

    s = make(eos=(stop_tok,))
    finished = drive(s, {0: [Req("eos", prompt, SamplingParams(max_tokens=12)),
                             Req("ign", prompt, SamplingParams(max_tokens=12, ignore_eos=True))]}, overlap=overlap)
    assert finished["eos"].output_ids == full[: k + 1] and finished["eos"].finished_reason.matched == stop_tok
    assert finished["ign"].output_ids == full and finished["ign"].finished_reason.kind == FinishKind.LENGTH


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_strings_use_a_tail_window(overlap):
    prompt = [1, 2, 3]
    full = reference(prompt, SamplingParams(max_tokens=60))
    text = detok(full)
    stop = text[40:43]
    end = text.index(stop) + len(stop)  # one char per token
    calls: list[int] = []

    def counting_detok(ids):
        calls.append(len(ids))
        return detok(ids)

    s = make(detokenize=counting_detok)
    r = drive(s, {0: [Req("a", prompt, SamplingParams(max_tokens=60, stop=("zzzzzzzz", stop)))]},
              overlap=overlap)["a"]
    assert r.output_ids == full[:end]
    assert r.finished_reason.kind == FinishKind.STOP and r.finished_reason.matched == stop
    assert max(calls) <= 4 * 8 + 1 < len(r.output_ids)


def test_bad_requests_are_refused():
    s = make(max_total_tokens=20, ctx=16, detokenize=None, max_queued_requests=2)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(Req("a", [], SamplingParams()))
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(Req("b", list(range(16)), SamplingParams()))  # no room for an output token
    assert e.value.field == "prompt"
    s2 = make(max_total_tokens=8, ctx=64)
    with pytest.raises(InvalidRequestError) as e:
        s2.add_request(Req("c", list(range(9)), SamplingParams()))  # larger than the KV pool
    assert e.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(Req("d", [1], SamplingParams(stop=("x",))))
    assert e.value.field == "stop"
    s.add_request(Req("e", [1], SamplingParams()))
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(Req("e", [2], SamplingParams()))
    assert e.value.field == "rid"
    s.add_request(Req("f", [1], SamplingParams()))
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(Req("g", [1], SamplingParams()))
    assert e.value.field == "queue"
    assert not s.tree_cache.total_size() and s.num_waiting == 2


def test_abort_waiting_running_chunked_and_in_flight():
    s = make(chunked_prefill_size=5, max_running_requests=2)
    rank = FakeRank(s)
    shared = [7] * 8

    def step():
        b = s.get_next_batch_to_run()
        out = s.process_batch_result(b, rank.step(b.worker_batch))
        s.check_memory_invariants()
        return out

    s.add_request(Req("warm", shared + [1], SamplingParams(max_tokens=2)))
    while s.has_unfinished():
        step()
    s.add_request(Req("run", shared + [2, 3], SamplingParams(max_tokens=50)))  # locks the cached prefix
    s.add_request(Req("chunk", list(range(30)), SamplingParams(max_tokens=50)))
    s.add_request(Req("wait", [1, 2, 3], SamplingParams(max_tokens=50)))
    step()
    step()
    assert s.chunked_req is not None and s.chunked_req.rid == "chunk"
    assert [r.rid for r in s.running] == ["run"] and [r.rid for r in s.waiting] == ["wait"]
    assert s.tree_cache.protected_size() > 0

    for rid in ("wait", "chunk", "run"):
        r = s.abort_request(rid)
        assert r.rid == rid and r.finished_reason.kind == FinishKind.ABORT and r.req_pool_idx is None
        s.check_memory_invariants()
    assert s.abort_request("run") is None and s.abort_request("nope") is None
    assert_clean(s)

    # Aborted while its batch is in flight: the result row is skipped and nothing leaks.
    s.add_request(Req("x", shared + [9], SamplingParams(max_tokens=5)))
    s.add_request(Req("y", [5, 6], SamplingParams(max_tokens=5)))
    b = s.get_next_batch_to_run()
    s.abort_request("x")
    out = s.process_batch_result(b, rank.step(b.worker_batch))
    assert [r.rid for r in out] == ["y"]
    s.check_memory_invariants()
    while s.has_unfinished():
        step()
    assert_clean(s)


def test_two_batches_in_flight_at_most_and_results_oldest_first():
    s = make()
    s.add_request(Req("a", [1, 2], SamplingParams(max_tokens=3)))
    b = s.get_next_batch_to_run()
    b2 = s.get_next_batch_to_run()  # overlap: formed before b's token is known, it reads it through a placeholder
    table = SamplingTable()
    assert table.resolve(b.worker_batch).output_lens == [0] and b.worker_batch.sampling_rows
    assert b2.worker_batch.input_ids == [-1] and table.resolve(b2.worker_batch).output_lens == [1]
    assert not b2.worker_batch.sampling_rows  # sent once, with the request's first step
    with pytest.raises(RuntimeError, match="^process_batch_result must be called for the oldest batch in flight "
                                           "first$"):
        s.get_next_batch_to_run()
    with pytest.raises(ValueError):
        s.process_batch_result(b2, StepOutput(next_token_ids=[4]))  # not the oldest
    with pytest.raises(ValueError):
        s.process_batch_result(b, StepOutput(next_token_ids=[]))
    s.process_batch_result(b, StepOutput(next_token_ids=[3]))
    assert s.running[0].output_ids == [3] and s.running[0].pending_ids == [-1]
    with pytest.raises(ValueError):
        s.process_batch_result(b, StepOutput(next_token_ids=[3]))
    s.process_batch_result(b2, StepOutput(next_token_ids=[4]))
    assert s.running[0].output_ids == [3, 4] and s.running[0].pending_ids == []


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 10),
    shared=st.integers(0, 12),
    pool=st.integers(31, 400),  # prompts have at most 31 tokens; small pools cut sequences (LENGTH)
    chunk=st.one_of(st.none(), st.integers(1, 16)),
    max_prefill=st.integers(4, 64),
    rows=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "lpm"]),
    radix=st.booleans(),
    spread=st.integers(0, 5),
    aborts=st.dictionaries(st.integers(0, 9), st.integers(0, 60), max_size=3),
    overlap=st.booleans(),
    mixed=st.booleans(),
)
def test_random_workloads(seed, n, shared, pool, chunk, max_prefill, rows, policy, radix, spread, aborts, overlap,
                          mixed):
    specs = workload(n=n, shared=shared, seed=seed, max_tokens=(1, 30))
    s = make(max_total_tokens=pool, radix=radix, chunked_prefill_size=chunk, max_prefill_tokens=max_prefill,
             max_running_requests=rows, schedule_policy=policy, enable_mixed_chunk=mixed)
    plan: dict[int, list[str]] = {}
    for i, step in aborts.items():
        plan.setdefault(step, []).append(f"r{i}")
    finished = drive(s, stagger(specs, lambda i: spread * i), aborts=plan, overlap=overlap)
    for rid, prompt, params in specs:
        r, want = finished[rid], reference(prompt, params, ctx=min(512, pool + 1))
        if r.finished_reason.kind == FinishKind.ABORT:
            assert r.output_ids == want[: len(r.output_ids)], rid
        else:
            assert r.output_ids == want, rid


def test_lpm_orders_by_cached_prefix_without_touching_the_cache():
    s = make(schedule_policy="lpm")
    drive(s, {0: [Req("warm", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=1))]})
    hits, queried = s.tree_cache.hit_tokens, s.tree_cache.queried_tokens
    waiting = [Req("none", [9, 9, 9], SamplingParams()), Req("short", [1, 2, 7], SamplingParams()),
               Req("long", [1, 2, 3, 4, 8], SamplingParams()), Req("short2", [1, 2, 8], SamplingParams())]
    for i, r in enumerate(waiting):
        r.arrival = i
    assert [r.rid for r in order_waiting(waiting, "lpm", s.tree_cache)] == ["long", "short", "short2", "none"]
    assert [r.rid for r in order_waiting(waiting, "fcfs", s.tree_cache)] == ["none", "short", "long", "short2"]
    assert (s.tree_cache.hit_tokens, s.tree_cache.queried_tokens) == (hits, queried)
