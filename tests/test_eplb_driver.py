"""The drivers carry expert load balancing end to end without models: each step's ``ExpertUpdate`` reaches every
DP group's batch identically, the ranks' cumulative counters come back (in-process groups through ``StepOutput``,
group processes through ``GroupReply``) and the driver's window holds exactly the pairs the fake ranks counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_supervision import EOS, VOCAB, FakeExecutor, detokenize  # noqa: E402

from raymoe.actors.driver import Driver  # noqa: E402
from raymoe.actors.hosted_driver import HostedDriver  # noqa: E402
from raymoe.actors.loopback_groups import LoopbackGroups  # noqa: E402
from raymoe.actors.output_batch import OutputBatch  # noqa: E402
from raymoe.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from raymoe.eplb.controller import EplbController  # noqa: E402
from raymoe.eplb.location import ExpertLocation  # noqa: E402
from raymoe.scheduler.sampling_params import SamplingParams  # noqa: E402
from raymoe.step.step_output import StepOutput  # noqa: E402

L, E, P, EP = 2, 4, 6, 2


def expert_of(token: int, layer: int) -> int:
    """The fake router: a function of the token, hot on expert 2 (one slot in the trivial placement)."""
    return 2 if token % 3 else (token + layer) % E


class CountingRanks(FakeExecutor):
    """The fake model of ``FakeExecutor`` plus expert counters: each input token routes to one expert per layer;
    a step whose update asks attaches the group's cumulative counts. Keeps every step's updates per group."""

    def __init__(self):
        super().__init__()
        self.counts: dict[int, list[int]] = {}
        self.updates: list[list] = []

    def execute(self, batches):
        outs = super().execute(batches)
        self.updates.append([b.expert_update for b in batches])
        answered = []
        for g, (b, out) in enumerate(zip(batches, outs, strict=True)):
            counts = self.counts.setdefault(g, [0] * (L * E))
            for t in b.input_ids:
                for layer in range(L):
                    counts[layer * E + expert_of(t if t >= 0 else 1, layer)] += 1
            report = b.expert_update is not None and b.expert_update.report_load
            answered.append(StepOutput(out.next_token_ids, expert_load=list(counts) if report else None))
        return answered


def controller() -> EplbController:
    return EplbController(ExpertLocation.trivial(L, E, P), EP, enable_eplb=True, record_interval=2,
                          window_steps=10_000, rebalance_every=5, min_window_tokens=1, experts_per_step=1)


def config() -> EngineConfig:
    return EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=512, max_context_len=128),
                        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=None))


def _drive(driver, ranks_of) -> list:
    prompts = [[5, 6, 7], [9, 3], [2, 4, 8, 1], [12]]
    for i, p in enumerate(prompts):
        driver.submit(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0))
    for _ in range(200):
        if not driver.has_unfinished():
            break
        driver.step()
    assert not driver.has_unfinished()
    return ranks_of()


@pytest.mark.parametrize("hosted", [False, True])
def test_updates_reach_every_group_and_the_load_comes_back(hosted):
    eplb = controller()
    if hosted:
        made: list[CountingRanks] = []

        def make(d):
            made.append(CountingRanks())
            return made[-1]

        groups = LoopbackGroups(config(), [EOS], detokenize, VOCAB, make, OutputBatch().extend, 2)
        driver = HostedDriver(config(), groups, 2, vocab_size=VOCAB, eplb=eplb)
        per_group = _drive(driver, lambda: made)
        steps = [[u[0] for u in r.updates] for r in per_group]  # each group's own batch, step by step
        counts = [r.counts[0] for r in per_group]
    else:
        ranks = CountingRanks()
        driver = Driver(config(), ranks, [EOS], detokenize, dp_size=2, vocab_size=VOCAB, eplb=eplb)
        _drive(driver, lambda: ranks)
        steps = [[u[g] for u in ranks.updates] for g in range(2)]
        counts = [ranks.counts[g] for g in range(2)]
    assert steps[0] == steps[1], "every group's ranks get the same update at the same step"
    assert any(u is not None and u.report_load for u in steps[0])
    assert eplb.num_rebalances >= 1 and any(u is not None and u.commit is not None for u in steps[0])
    # the window holds the counts up to the last report: at most the total, and all of it from the reports seen
    window = eplb.window_load().view(-1).tolist()
    total = [a + b for a, b in zip(*counts, strict=True)]
    assert 0 < sum(window) <= sum(total) and all(w <= t for w, t in zip(window, total, strict=True))
    assert window[2] == max(window[:E]), "expert 2 is the hot one in layer 0"
