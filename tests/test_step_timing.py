"""Step timing (``raymoe.actors.step_timing``): mode labels, the period rule, histogram buckets, and the driver's
records against its own step counters."""

from __future__ import annotations

import pytest

from raymoe.actors.step_timing import STEP_BUCKETS_S, Histogram, StepTimer, step_mode
from raymoe.step.forward_mode import ForwardMode as FM


def test_step_mode_labels_a_step_by_its_groups():
    assert step_mode([FM.DECODE]) == "decode"
    assert step_mode([FM.DECODE, FM.IDLE]) == "decode"
    assert step_mode([FM.MIXED, FM.DECODE]) == "mixed"
    assert step_mode([FM.EXTEND, FM.MIXED]) == "mixed"
    assert step_mode([FM.EXTEND, FM.IDLE]) == "extend"
    assert step_mode([FM.TARGET_VERIFY, FM.IDLE, FM.DECODE]) == "verify"
    assert step_mode([FM.TARGET_VERIFY, FM.EXTEND]) == "extend"
    with pytest.raises(ValueError):
        step_mode([])


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _bucket(value: float) -> int:
    return next((i for i, le in enumerate(STEP_BUCKETS_S) if value <= le), len(STEP_BUCKETS_S))


def test_period_is_the_time_between_results_while_busy_and_never_counts_idle_time():
    clock = Clock()
    timer = StepTimer(clock)
    clock.t = 100.012  # the first step: sent at 100.000, nothing collected before it
    assert timer.collected("extend", 100.000, 0.009) == pytest.approx(0.012)
    clock.t = 100.016  # overlap: the next step was sent before the previous result came back
    assert timer.collected("decode", 100.008, 0.003) == pytest.approx(0.004)
    clock.t = 100.019
    assert timer.collected("decode", 100.014, 0.0025) == pytest.approx(0.003)
    clock.t = 105.003  # after 5 s idle: sent at 105.000, so the idle spell is not counted
    assert timer.collected("mixed", 105.000, 0.0029) == pytest.approx(0.003)

    snap = timer.snapshot()
    assert snap.period["decode"].count == 2 and snap.period["mixed"].count == 1 and snap.period["extend"].count == 1
    assert snap.period["decode"].total == pytest.approx(0.007)
    assert snap.forward["decode"].total == pytest.approx(0.0055)
    assert snap.forward["mixed"].counts[_bucket(0.0029)] == 1
    assert snap.period["extend"].counts[_bucket(0.012)] == 1
    # The snapshot is a copy: later steps do not change it.
    timer.collected("decode", 105.0, 1.0)
    assert snap.period["decode"].count == 2


def test_histogram_is_cumulative_with_an_infinite_last_bucket():
    timer = StepTimer(Clock())
    for seconds in (0.0001, 0.004, 0.004, 99.0):
        timer.collected("decode", 0.0, seconds)
    hist = timer.snapshot().forward["decode"]
    pairs = hist.cumulative()
    assert pairs[0] == (str(STEP_BUCKETS_S[0]), 1)
    assert dict(pairs)["0.004"] == 3  # a bound holds the values equal to it (Prometheus "le")
    assert dict(pairs)[str(STEP_BUCKETS_S[-1])] == 3 and pairs[-1] == ("+Inf", 4)
    assert [n for _, n in pairs] == sorted(n for _, n in pairs)
    with pytest.raises(ValueError, match="buckets"):
        Histogram((1, 2), 0.0)


def test_driver_times_every_step_under_its_mode(tiny_model):
    from raymoe import Engine, SamplingParams

    with Engine(tiny_model, max_running_requests=4, chunked_prefill_size=64) as engine:
        driver = engine.driver
        # Record every launched step's forward modes at the executor, independently of the driver's labelling.
        launched: list[list[FM]] = []
        launch = driver.executor.launch

        def recording_launch(batches):
            launched.append([b.forward_mode for b in batches])
            return launch(batches)

        driver.executor.launch = recording_launch
        prompts = [list(range(5 + i, 40 + i)) for i in range(6)]
        engine.generate(prompt_token_ids=prompts,
                        sampling_params=[SamplingParams(max_tokens=3 + 4 * i, ignore_eos=True) for i in range(6)])
        snap = driver.step_timer.snapshot()
    seen = {"decode": sum(all(m in (FM.DECODE, FM.IDLE) for m in step) for step in launched),
            "mixed": sum(FM.MIXED in step for step in launched)}
    seen["extend"] = len(launched) - seen["decode"] - seen["mixed"]
    seen["verify"] = 0  # no speculative decoding here
    assert len(launched) == driver.num_steps and seen["mixed"] > 0  # the last two prompts join running decodes
    assert seen["decode"] > 0 and seen["extend"] > 0 and driver.num_mixed_steps == seen["mixed"]
    for hists in (snap.period, snap.forward):
        assert {m: h.count for m, h in hists.items()} == seen
        assert all(h.total > 0 for m, h in hists.items() if seen[m])
