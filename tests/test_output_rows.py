"""The output rows a group writes per step (``GroupScheduler.record`` into an ``OutputBatch``): the columns gathered
for the common row (one new token, request goes on, no log-probabilities) give the same batches, row for row, as
building every row one request at a time. Random workloads on a real Driver with a fake executor: requests arrive
over time, some ask for log-probabilities, some end by a stop token, by max_tokens or by an abort, on two DP groups,
with overlap scheduling on and off."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raymoe.actors.driver import Driver
from raymoe.actors.group_scheduler import GroupScheduler
from raymoe.actors.output_batch import OutputBatch
from raymoe.config import CacheConfig, EngineConfig, SchedulerConfig
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.sampling_table import SamplingTable
from raymoe.step.step_output import StepOutput, TokenLogprobs

EOS = 0


class VariedExecutor:
    """Answers row ``i`` of a step with a token that depends on the step and the row (now and then EOS or 3, a
    stop id of some requests), with log-probabilities for the rows that ask for them."""

    def __init__(self):
        self.steps = 0
        self.tables: dict[int, SamplingTable] = {}  # each group's, as its ranks keep them

    def execute(self, batches):
        self.steps += 1
        outs = []
        for g, b in enumerate(batches):
            tokens = [(self.steps * 7 + i * 5) % 23 for i in range(b.batch_size)]
            sampling = self.tables.setdefault(g, SamplingTable()).resolve(b)
            asked = [k is not None for k in sampling.logprobs] if sampling else []
            lps = [TokenLogprobs(-0.1 * t, [t], [-0.1 * t]) if a else None for t, a in zip(tokens, asked, strict=True)]
            outs.append(StepOutput(tokens, lps if any(asked) else []))
        return outs

    def launch(self, batches):
        return self.execute(batches)

    def collect(self, handle):
        return handle

    def ranks_alive(self) -> bool:
        return True


def run(seed: int, overlap: bool, one_by_one: bool) -> list[OutputBatch]:
    """Every step's output batch of one seeded workload; ``one_by_one``: each row built by ``_record_one``."""
    rng = random.Random(seed)
    config = EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=512, max_context_len=64),
                          scheduler=SchedulerConfig(max_running_requests=6, chunked_prefill_size=8,
                                                    disable_overlap_schedule=not overlap))
    d = Driver(config, VariedExecutor(), [EOS], None, dp_size=2, vocab_size=100)
    d.record_outputs = True
    arrivals = {rng.randrange(12): [] for _ in range(6)}
    for i in range(14):
        step = rng.choice(list(arrivals))
        params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0,
                                logprobs=rng.choice([None, None, 1]), stop_token_ids=rng.choice([(), (3,)]),
                                ignore_eos=rng.random() < 0.5)
        arrivals[step].append((f"r{i}", [1 + rng.randrange(90) for _ in range(rng.randrange(1, 12))], params))
    aborts = {rng.randrange(20): f"r{rng.randrange(14)}" for _ in range(3)}
    batches = []
    with pytest.MonkeyPatch.context() as mp:
        if one_by_one:
            mp.setattr(GroupScheduler, "record", lambda self, reqs: [self._record_one(r) for r in reqs] and None)
        for step in range(200):
            for rid, prompt, params in arrivals.get(step, []):
                d.submit(rid, prompt, params)
            if step in aborts:
                d.abort_request(aborts[step])
            d.step()
            batches.append(d.take_outputs())
            if step > max(arrivals) and not d.has_unfinished():
                break
    return batches


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), overlap=st.booleans())
def test_gathered_rows_equal_rows_built_one_by_one(seed, overlap):
    gathered = run(seed, overlap, one_by_one=False)
    assert gathered == run(seed, overlap, one_by_one=True)
    rows = [delta for batch in gathered for delta in batch]
    assert sum(d.finished for d in rows) == 14  # every request ended in a row (done, stopped, aborted or refused)
