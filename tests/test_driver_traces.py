"""Driver decisions and rank traces together: workloads run through the real ``Driver`` with the checking fake
executor of ``test_driver_agreement`` (which keeps every step's batches), then those batches are replayed on two
spawned gloo ranks built as the engine builds them (``runner_config_for``), under a collective recording with the
pre-call store check; the test compares the traces again. One fixed workload (EXTEND TBO, DECODE ``fine`` TBO
beside an IDLE group, MIXED and low-latency steps) and a few random ones (graphs, a2a modes, schedules ...): each
spawn costs seconds, so the random sample is small; the decisions alone get a thousand workloads in
``test_driver_agreement``."""

from __future__ import annotations

import dataclasses

from dist_harness import run_ranks
from hypothesis import HealthCheck, given, settings
from test_driver_agreement import run_workload, workloads
from trace_scenarios import replayed_driver_steps

from raymoe.comm.trace_compare import check_step_traces
from raymoe.config import CacheConfig, EngineConfig, GraphConfig, OverlapConfig, ParallelConfig, SchedulerConfig

MAX_REPLAYED_STEPS = 40


def _replay(model: str, w: dict) -> list[list]:
    """Run ``w`` through the driver, replay its first steps on dp = ep = 2 ranks; returns the sent batches."""
    log = run_workload(w).log[:MAX_REPLAYED_STEPS]
    config = dataclasses.replace(w["config"], model=model, parallel=ParallelConfig(dp_size=2, ep_size=2))
    per_rank = run_ranks(replayed_driver_steps, config.parallel, config, log, timeout_s=300)
    for i in range(len(log) + 1):
        check_step_traces([traces[i] for traces in per_rank], step=i)
    return log


def test_a_fixed_driver_workload_gives_agreeing_traces_on_real_ranks(tiny_model):
    overlap = OverlapConfig(enable_tbo=True, tbo_min_tokens_decode=2, tbo_min_tokens_extend=4,
                            tbo_decode_schedule="fine")
    config = EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=40, max_context_len=48),
                          scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=8), overlap=overlap,
                          graph=GraphConfig(disable_cuda_graph=True))
    events = [(0, "add", f"a{i}", [3 + i] * 9, 2 if i % 2 else 12) for i in range(4)]
    events += [(6, "add", "late", [40] * 7, 3), (9, "add", "short", [41, 42], 1)]
    log = _replay(tiny_model, {"config": config, "dp": 2, "events": events, "eos_every": 0})
    kinds = [({b.forward_mode.name for b in step}, step[0].use_tbo) for step in log]
    assert any(tbo and modes == {"DECODE", "IDLE"} for modes, tbo in kinds), kinds  # the fine schedule beside IDLE
    assert any(tbo and modes == {"EXTEND"} for modes, tbo in kinds) and any("MIXED" in m for m, _ in kinds), kinds
    assert any(step[0].dispatch_capacity is not None for step in log)  # low-latency decode steps


@settings(max_examples=3, deadline=None, derandomize=False, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads(dp=2))
def test_sampled_driver_workloads_give_agreeing_traces_on_real_ranks(tiny_model, w):
    _replay(tiny_model, w)
