"""Speculative decoding in the group scheduler (``raymoe.scheduler.spec_steps``), against the fake rank of
``test_scheduler``: TARGET_VERIFY steps give every request the tokens of plain greedy decoding, stop tokens, stop
strings and length limits inside accepted drafts end a request where plain decoding would, rejected drafts' KV
slots go back (token and paged pools), and nothing leaks."""

from __future__ import annotations

import dataclasses
import random

import pytest
from test_scheduler import VOCAB, FakeRank, drive, make, reference, stagger

from raymoe.config import SpeculativeConfig
from raymoe.scheduler.ngram import propose_ngram
from raymoe.scheduler.req import Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.spec_steps import SpecCounters
from raymoe.step.forward_mode import ForwardMode

NGRAM = SpeculativeConfig(speculative_algorithm="ngram", speculative_num_steps=4)


def cycling(seq: list[int]) -> int:
    """A fake model whose text repeats (n-gram drafts are often right): the next token depends on the last two."""
    return (seq[-1] * 5 + (seq[-2] if len(seq) > 1 else 0) * 3 + 1) % 11


def noisy(seq: list[int]) -> int:
    """Mostly ``cycling``, with a deviation now and then (drafts partly rejected)."""
    return (cycling(seq) + (len(seq) % 7 == 0)) % VOCAB


def specs(n: int, seed: int, max_tokens=(1, 40)):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(11) for _ in range(rng.randrange(2, 20))]
        params = SamplingParams(max_tokens=rng.randint(*max_tokens), temperature=0.0,
                                stop_token_ids=(rng.randrange(11),) if i % 3 == 0 else (),
                                stop=("jk",) if i % 5 == 1 else ())
        out.append((f"r{i}", prompt, params))
    return out


@pytest.mark.parametrize("model", [cycling, noisy])
@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("pool", [4096, 160])
def test_verify_steps_give_the_tokens_of_plain_decoding(model, page_size, pool):
    workload = specs(16, seed=pool + (page_size or 0))
    s = make(max_total_tokens=pool, page_size=page_size, speculative=NGRAM, max_running_requests=8)
    rank = FakeRank(s, model)
    finished = drive(s, stagger(workload, lambda i: i // 3), rank=rank)
    for rid, prompt, params in workload:
        assert finished[rid].output_ids == reference(prompt, params, model=model), rid
    assert ForwardMode.TARGET_VERIFY in rank.modes_seen
    c = s.spec.counters()
    assert c.verify_steps > 0 and c.accepted_tokens > 0 and sum(c.accept_len_counts) > 0
    if model is cycling:
        assert c.acceptance_rate > 0.2, c


def test_drafts_never_run_past_max_tokens_and_rows_without_drafts_decode():
    s = make(speculative=NGRAM)
    rank = FakeRank(s, cycling)
    work = [(f"m{n}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=n, temperature=0.0)) for n in (1, 2, 3, 7)]
    finished = drive(s, stagger(work, lambda i: 0), rank=rank)
    for rid, prompt, params in work:
        out = finished[rid].output_ids
        assert len(out) <= params.max_tokens and out == reference(prompt, params, model=cycling)


def test_requests_with_logprobs_run_plain_decode_steps():
    s = make(speculative=NGRAM)
    rank = FakeRank(s, cycling)
    work = [("lp", [1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=12, temperature=0.0, logprobs=0))]
    drive(s, stagger(work, lambda i: 0), rank=rank)
    assert ForwardMode.TARGET_VERIFY not in rank.modes_seen


def test_counters_sum_over_groups():
    a = SpecCounters(2, 8, 5, (1, 2, 0, 1))
    b = SpecCounters(1, 4, 4, (0, 0, 0, 0, 1))
    total = SpecCounters.total([a, None, b])
    assert total == SpecCounters(3, 12, 9, (1, 2, 0, 1, 1))
    assert total.acceptance_rate == 0.75 and SpecCounters.total([None]) is None


def test_ngram_drafts_are_the_continuation_of_the_latest_match():
    s = make(speculative=NGRAM)
    req = Req("x", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=3, temperature=0.0))
    req.limits = s.state.limits_for(req)
    # three tokens left, one of them the target's own: at most two drafts
    assert s.spec.draft_for(req) == [7, 8]
    assert propose_ngram([5, 6, 7, 8, 5, 6], 4, 1, 3) == [7, 8, 5, 6]


def test_draft_policy_fits_the_step_cost_and_drafts_only_what_pays():
    from raymoe.scheduler.spec_policy import EXPLORE_EVERY, PROBE_EVERY, DraftPolicy

    pol = DraftPolicy()
    assert pol.verify_cost.fit() is None and pol.threshold(32) == 0.0  # before a fit: every draft
    for tokens in (1, 4, 8, 32, 64, 128) * 5:
        pol.observe_step(True, tokens, 0.004 + 0.0005 * tokens)  # verify: a = 4 ms, b = 0.5 ms per token
    a, b = pol.verify_cost.fit()
    assert a == pytest.approx(0.004, rel=1e-6) and b == pytest.approx(0.0005, rel=1e-6)
    assert pol.threshold(1) == pytest.approx(0.0005 / 0.0045)  # the verify fit stands in for decode's
    for _ in range(10):
        pol.observe_step(False, 64, 0.002 + 0.0005 * 64)  # decode steps of 64 rows (a graph: less fixed cost)
    assert pol.decode_cost.at(64) == pytest.approx(0.034)
    assert pol.threshold(64) == pytest.approx(0.0005 / (0.034 / 64))
    for _ in range(20):  # a request whose drafts are nearly always right
        pol.observe_row("sure", 4, 4)
    for _ in range(20):  # one whose first draft mostly fails
        pol.observe_row("unsure", 4, 0)
    assert pol.draft_len("sure", 4, 1) == 4 and pol.draft_len("sure", 4, 64) >= 1
    assert pol.draft_len("unsure", 4, 1) >= 1  # at batch 1 the fixed cost dominates: a draft still pays
    lengths = [pol.draft_len("unsure", 4, 64) for _ in range(PROBE_EVERY)]
    assert lengths == [0] * (PROBE_EVERY - 1) + [1]  # compute-bound: only a probe now and then
    # a step of 64 sure rows with 4 drafts each pays; 64 unsure rows with one draft each does not
    decisions = [pol.worth_verifying([("sure", 4)] * 64, 64) for _ in range(EXPLORE_EVERY)]
    assert decisions.count(True) == EXPLORE_EVERY - 1  # a run of EXPLORE_EVERY is flipped (exploration)
    decisions = [pol.worth_verifying([("unsure", 1)] * 64, 64) for _ in range(EXPLORE_EVERY)]
    assert decisions.count(True) == 1
    pol.forget("unsure")
    pol.prune(set())
    assert pol.acceptance("sure") > 0.9


def test_adaptive_and_fixed_policies_give_the_same_tokens():
    work = specs(10, seed=7)
    outs = {}
    for policy in ("adaptive", "fixed"):
        cfg = SpeculativeConfig(speculative_algorithm="ngram", speculative_draft_policy=policy)
        s = make(speculative=cfg, max_running_requests=8)
        finished = drive(s, stagger(work, lambda i: i // 2), rank=FakeRank(s, noisy))
        outs[policy] = {rid: r.output_ids for rid, r in finished.items()}
    assert outs["adaptive"] == outs["fixed"]


@pytest.mark.parametrize("model", [cycling, noisy])
def test_mixed_steps_verify_their_decode_rows_drafts(model):
    """With MIXED steps on, arrivals keep prefilling while running requests decode: their decode rows verify drafts
    inside the MIXED batches, and every request still gets the tokens of plain decoding."""
    workload = specs(16, seed=11, max_tokens=(8, 40))
    s = make(speculative=NGRAM, max_running_requests=8, enable_mixed_chunk=True, chunked_prefill_size=12)
    rank = FakeRank(s, model)
    step, mixed_with_drafts = rank.step, []

    def watched(b):
        if b.forward_mode == ForwardMode.MIXED and any(b.draft_lens):
            mixed_with_drafts.append(b)
        return step(b)

    rank.step = watched
    finished = drive(s, stagger(workload, lambda i: i), rank=rank)
    for rid, prompt, params in workload:
        assert finished[rid].output_ids == reference(prompt, params, model=model), rid
    assert mixed_with_drafts and s.spec.counters().accepted_tokens > 0


def test_draft_passes_are_one_decision_for_every_rank_and_pause_when_drafts_do_not_pay():
    from raymoe.actors.step_decision import StepRules, decide_step
    from raymoe.config import OverlapConfig
    from raymoe.scheduler.spec_policy import EXPLORE_EVERY
    from raymoe.step.step_plan import GroupPlan

    rules = StepRules(OverlapConfig(enable_tbo=False), (), "auto", 64)
    wanting = [GroupPlan(ForwardMode.DECODE, 4, 4, draft_passes=True), GroupPlan(ForwardMode.IDLE, 0, 0)]
    decision = decide_step(wanting, rules)
    assert decision.draft_passes  # one group wants drafts: every rank runs the passes (their MoE collectives)
    assert decision.apply(None).draft_passes and not decide_step([GroupPlan.idle()] * 2, rules).draft_passes

    s = make(speculative=SpeculativeConfig(speculative_algorithm="nextn"))
    spec = s.spec
    assert spec.wants_draft_passes()  # before any decision: draft
    spec._last_verified = False  # the policy declined the last drafts
    assert not spec.wants_draft_passes()
    spec._steps_without_passes = EXPLORE_EVERY
    assert spec.wants_draft_passes()  # explore now and then
    fixed = make(speculative=SpeculativeConfig(speculative_algorithm="nextn", speculative_draft_policy="fixed"))
    fixed.spec._last_verified = False
    assert fixed.spec.wants_draft_passes()
    assert not make(speculative=NGRAM).spec.wants_draft_passes()  # ngram drafts on the scheduler


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
@pytest.mark.parametrize("mixed", [False, True])
def test_overlap_scheduling_between_verify_steps_gives_the_tokens_of_plain_decoding(policy, mixed):
    """The driver's rules under overlap scheduling (``drive(overlap=True)``): a step is formed while the one before
    runs unless the group may draft, and a verify step is applied before the next one is formed. Rows formed with
    a token pending get no draft; every request gets plain decoding's tokens. The first 8 requests verify drafts;
    the 8 that arrive later ask for log-probs, so their steps cannot verify: with the adaptive policy those steps
    overlap, with fixed drafting none does (it always waits for fresh tokens)."""
    workload = [(rid, prompt, dataclasses.replace(params, logprobs=0) if i >= 8 else params)
                for i, (rid, prompt, params) in enumerate(specs(16, seed=5, max_tokens=(8, 40)))]
    cfg = SpeculativeConfig(speculative_algorithm="ngram", speculative_draft_policy=policy)
    s = make(speculative=cfg, max_running_requests=8, enable_mixed_chunk=mixed, chunked_prefill_size=12)
    rank = FakeRank(s, noisy)
    step, overlapped = rank.step, []

    def watched(b):
        overlapped.append(bool(b.input_ids) and min(b.input_ids) < 0)  # placeholders: formed with tokens pending
        return step(b)

    rank.step = watched
    finished = drive(s, stagger(workload, lambda i: i // 2 if i < 8 else 60 + i), rank=rank, overlap=True)
    for rid, prompt, params in workload:
        assert finished[rid].output_ids == reference(prompt, params, model=noisy), rid
    assert s.spec.counters().verify_steps > 0
    assert any(overlapped) == (policy == "adaptive"), sum(overlapped)  # fixed drafting always wants fresh tokens


def test_draft_chain_scratch_never_outlives_its_step_under_overlap():
    """With a draft model the scheduler appends ``speculative_num_steps - 1`` scratch slots per sampling row for the
    ranks' draft chain and gives them back when the step's result is applied. While the adaptive policy pauses the
    passes, steps overlap: a step then carries no scratch (the chain does not run), and a step that does (the
    policy exploring) is applied before the next is formed, so a next decode slot never lands after scratch."""
    workload = specs(6, seed=3, max_tokens=(20, 40))
    s = make(speculative=SpeculativeConfig(speculative_algorithm="nextn", speculative_num_steps=3),
             max_running_requests=8)
    s.spec._last_verified = False  # the policy declined the last drafts: passes paused, steps overlap
    rank = FakeRank(s, noisy)  # answers no drafts (no draft model here), so the passes stay paused but to explore
    step, scratch_steps = rank.step, []

    def watched(b):
        scratch_steps.append(bool(b.spec_scratch_slots))
        return step(b)

    rank.step = watched
    finished = drive(s, {0: [Req(*w) for w in workload]}, rank=rank, overlap=True)
    for rid, prompt, params in workload:
        assert finished[rid].finished_reason is not None and finished[rid].output_ids == reference(
            prompt, params, model=noisy), rid
    from raymoe.scheduler.spec_policy import EXPLORE_EVERY

    assert len(scratch_steps) < EXPLORE_EVERY and not any(scratch_steps)  # paused throughout: no chain, no scratch


def test_a_run_of_overlapped_plain_steps_never_ends_in_a_flipped_verify_decision():
    """Exploration flips runs of one kind only: a look after a long overlapped stretch of plain decoding keeps the
    fits' verify choice (counting every EXPLORE_EVERY-th decision, overlapped steps included, flipped exactly
    that look, and its back-off made the next look a flip again: a batch-1 stream whose drafts paid decoded
    plainly), and a flipped verify decision keeps the draft model's passes running."""
    from raymoe.scheduler.spec_policy import EXPLORE_EVERY, DraftPolicy

    pol = DraftPolicy()
    for _ in range(10):  # plain step 9 ms, verify step of 2 tokens 10.5 ms; drafts accepted 4 times in 5
        pol.observe_step(False, 1, 0.009)
        pol.observe_step(True, 2, 0.0105)
    for i in range(10):
        pol.observe_row("r", 1, int(i % 5 != 0))
    for _ in range(3 * EXPLORE_EVERY):
        pol.skip_step(["r"])
    assert pol.worth_verifying([("r", 1)], 1) and not pol.explored
    decisions = [pol.worth_verifying([("r", 1)], 1) for _ in range(2 * EXPLORE_EVERY)]
    assert decisions.count(False) == 2 and decisions[EXPLORE_EVERY - 2] is False  # one flip per run of 64

    s = make(speculative=SpeculativeConfig(speculative_algorithm="nextn"))
    spec = s.spec
    spec.policy = pol
    pol._verify_run = EXPLORE_EVERY - 1  # the next verify choice is flipped
    req = Req("r", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0))
    req.limits = s.state.limits_for(req)
    req.spec_drafts = [7]
    assert spec.step_drafts([req]) is None and pol.explored
    assert spec.wants_draft_passes()  # an exploring plain step keeps the passes: the drafts still pay
