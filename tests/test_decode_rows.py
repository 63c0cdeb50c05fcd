"""DecodeRows (``raymoe.scheduler.decode_rows``): every DECODE batch it builds, with the columns it keeps between
steps, equals the batch ``ScheduleBatch.build`` makes from the same requests at that moment. Checked over random
workloads whose requests arrive, finish (stop ids, EOS, max_tokens, context, pool), are aborted and are retracted
(small pools), with overlap scheduling, MIXED batches and paged KV on and off, and with sampling numbers that differ
per request, so a kept column that belongs to another request set shows."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import VOCAB, FakeRank, drive, reference, stagger

from raymoe.config import CacheConfig, SchedulerConfig
from raymoe.scheduler.decode_rows import DecodeRows
from raymoe.scheduler.req import FinishKind, Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.scheduler.scheduler import Scheduler
from raymoe.step.forward_mode import ForwardMode

EOS = (5,)


@contextmanager
def checked_decode_rows():
    """Within the block every batch ``DecodeRows.build`` returns is compared with a fresh ``ScheduleBatch.build``;
    yields the counts of batches it built and of those it left to ``ScheduleBatch.build``."""
    built = DecodeRows.build
    counts = {"built": 0, "declined": 0}

    def build(self, reqs):
        batch = built(self, reqs)
        if batch is None:
            counts["declined"] += 1
            return None
        counts["built"] += 1
        fresh = ScheduleBatch.build(reqs, ForwardMode.DECODE, [1] * len(reqs))
        assert batch.worker_batch == fresh.worker_batch
        assert batch.partial == fresh.partial and all(a is b for a, b in zip(batch.reqs, fresh.reqs, strict=True))
        return batch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DecodeRows, "build", build)
        yield counts


def varied_workload(n: int, seed: int, shared: int = 0) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests whose sampling numbers differ (temperature, top-p, top-k, min-p, seed, logprobs) and which end by
    stop ids, EOS or max_tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(shared)]
    specs = []
    for i in range(n):
        prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.5, 1.0]), top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([-1, 0, 7]), min_p=rng.choice([0.0, 0.1]), seed=rng.choice([None, rng.randrange(99)]),
            logprobs=rng.choice([None, 0, 3]), stop_token_ids=tuple(rng.sample(range(VOCAB), rng.randrange(0, 3))),
            ignore_eos=rng.random() < 0.5)
        specs.append((f"r{i}", prompt, params))
    return specs


def make(pool: int, page: int = 1, radix: bool = True, **sched_kw) -> Scheduler:
    cache = CacheConfig(max_total_tokens=pool, max_context_len=64, enable_radix_cache=radix, page_size=page)
    return Scheduler(SchedulerConfig(**sched_kw), cache, eos_token_ids=EOS)


def test_steady_decode_reuses_its_columns_and_matches_a_fresh_build():
    specs = [(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=20, temperature=0.1 * i, seed=i, ignore_eos=True))
             for i in range(6)]
    s = make(pool=512)
    seen = []
    with checked_decode_rows() as counts:
        built = DecodeRows.build

        def keep(self, reqs):
            batch = built(self, reqs)
            seen.append(batch)
            return batch

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(DecodeRows, "build", keep)
            drive(s, {0: [Req(*spec) for spec in specs]}, overlap=True)
    assert counts["built"] >= 15 and counts["declined"] == 0
    a, b = seen[3].worker_batch, seen[4].worker_batch
    assert a.req_pool_indices == b.req_pool_indices and a.req_pool_indices is not b.req_pool_indices
    assert a.sampling is None and not a.sampling_rows  # the ranks hold every row's numbers since its first step
    assert a.seq_lens == [n - 1 for n in b.seq_lens]


def test_kept_columns_are_read_again_once_a_request_gave_its_kv_back():
    s = make(pool=512)
    a, b, c = (Req(f"{x}", [1, 2, i + 3], SamplingParams(max_tokens=20, ignore_eos=True)) for i, x in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    rank = FakeRank(s)
    while (batch := s.get_next_batch_to_run()) is not None and batch.worker_batch.forward_mode != ForwardMode.DECODE:
        s.process_batch_result(batch, rank.step(batch.worker_batch))
    s.process_batch_result(batch, rank.step(batch.worker_batch))
    for r in (a, b):  # as the next decode step allocates: one slot each, so the KV ends at the newest token
        r.kv_slots.append(s.token_allocator.alloc(1)[0])
    rows = DecodeRows(s.state)
    assert rows.build([a, b]).worker_batch == ScheduleBatch.build([a, b], ForwardMode.DECODE, [1, 1]).worker_batch
    s.abort_request("c")  # gives its KV back: whatever a and b hold now is read again
    b.req_pool_idx += 100
    again = rows.build([a, b]).worker_batch
    assert again.req_pool_indices[1] == b.req_pool_idx


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), n=st.integers(1, 10), shared=st.integers(0, 12), pool=st.integers(31, 300),
       page=st.sampled_from([1, 1, 4]), chunk=st.one_of(st.none(), st.integers(1, 16)), rows=st.integers(1, 8),
       radix=st.booleans(), spread=st.integers(0, 4),
       aborts=st.dictionaries(st.integers(0, 9), st.integers(0, 60), max_size=3), overlap=st.booleans(),
       mixed=st.booleans())
def test_random_workloads_decode_batches_equal_fresh_builds(seed, n, shared, pool, page, chunk, rows, radix, spread,
                                                             aborts, overlap, mixed):
    specs = varied_workload(n, seed, shared)
    s = make(max(pool // page, 8) * page, page=page, radix=radix, chunked_prefill_size=chunk, max_prefill_tokens=48,
             max_running_requests=rows, enable_mixed_chunk=mixed)
    specs = [spec for spec in specs if len(spec[1]) <= s.token_allocator.size]  # prompts the pool can hold
    plan: dict[int, list[str]] = {}
    for i, step in aborts.items():
        plan.setdefault(step, []).append(f"r{i}")
    with checked_decode_rows():
        finished = drive(s, stagger(specs, lambda i: spread * i), aborts=plan, overlap=overlap)
    ctx = min(64, s.token_allocator.size + 1)
    for rid, prompt, params in specs:
        r, want = finished[rid], reference(prompt, params, ctx=ctx, eos=EOS)
        if r.finished_reason.kind == FinishKind.ABORT:
            assert r.output_ids == want[: len(r.output_ids)], rid
        else:
            assert r.output_ids == want, rid
