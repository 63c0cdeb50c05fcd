"""The fault harness at CI size (``raymoe.bench.chaos_faults``, what ``raymoe bench chaos`` runs): a served
dp=2 x ep=2 engine whose 8 experts each have a slot on both ranks (8 redundant experts) and a small step bound, 16
greedy streams of 128 tokens per fault, the fault injected while every stream runs. Each fault ends with no failed
request, every stream's whole undisturbed text, and the idle invariant; a SIGSTOPped rank becomes a rank fault
within the step bound (the driver's watchdog), never a hang; a slow rank below the bound is no fault. A killed or
stopped rank shrinks the group onto the surviving rank (elastic EP: its process is kept) and a replacement rank
rejoins. Node removal needs a cluster of its own (``raymoe bench chaos``; the session's cluster keeps its nodes)."""

from __future__ import annotations

import pytest
from server_harness import uvicorn_server

STEP_BOUND_S = 4.0


@pytest.fixture(scope="module")
def harness(ray_cluster, tiny_model):
    from raymoe.bench.chaos_faults import ChaosHarness
    from raymoe.client.engine_client import EngineClient
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.engine import _split_options

    config = _split_options(tiny_model, {"dp_size": 2, "ep_size": 2, "ep_num_redundant_experts": 8,
                                         "step_timeout_s": STEP_BOUND_S, "max_context_len": 256,
                                         "elastic_ep_rejoin_after_s": 1.0})
    engine = EngineClient(config, model_name="tiny")
    try:
        with uvicorn_server(build_openai_app(engine, max_in_flight=256)) as url:
            yield ChaosHarness(engine, url, streams=16, max_tokens=128, stream_timeout_s=150.0, slow_delay_s=0.5,
                               slow_steps=6)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fault", ["sigkill_rank", "sigstop_rank", "slow_rank", "kill_driver"])
def test_a_fault_costs_a_pause_and_no_request(harness, fault):
    from raymoe.bench.chaos_faults import format_table

    result = harness.run(fault)
    print("\n" + format_table([result]))
    assert result.running_at_fault == 16, result  # the fault landed while every stream ran
    assert result.ok, (result, harness.notes)
    assert result.tokens_checked == 16 * 128
    if fault == "slow_rank":  # slower steps, no fault: nothing was resumed and health never dropped
        assert result.resumed == 0 and result.detected_s is None
        assert result.longest_pause_s >= 0.5
    else:
        assert result.resumed >= 16 and result.detected_s is not None and result.recovered_s is not None
    if fault in ("sigkill_rank", "sigstop_rank"):  # elastic EP: served on the survivor, then grown back
        assert (result.recovery, result.ranks_kept) == ("shrink", 1), result
        assert result.regrown_s is not None and result.steps_shrunk > 0, (result, harness.notes)
    if fault == "sigstop_rank":  # the watchdog turned the stopped rank into a fault within its bound
        assert result.detected_s <= STEP_BOUND_S + 3.0, result
        assert not harness.notes, harness.notes


def test_a_rank_killed_while_idle_is_found_without_a_request(harness):
    """No request runs: the service's idle probe (every ``IDLE_PROBE_INTERVAL_S``) finds the killed rank, health
    drops, the group shrinks onto the survivor and grows back, all before the next request, which then gets its
    undisturbed tokens."""
    import asyncio
    import os
    import signal
    import time

    import ray

    from raymoe.actors.driver_service import IDLE_PROBE_INTERVAL_S

    def stats():
        return ray.get(harness.engine.driver.stats.remote(), timeout=30)

    before = stats()
    _, pid = harness._rank()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + IDLE_PROBE_INTERVAL_S + 60
    while stats().ep_grows <= before.ep_grows and time.monotonic() < deadline:
        time.sleep(0.2)
    after = stats()
    assert (after.ep_shrinks - before.ep_shrinks, after.ep_grows - before.ep_grows) == (1, 1), after
    assert after.healthy and after.dp_size == 2 and after.rank_restarts == before.rank_restarts
    outs, _, _ = asyncio.run(harness._run())
    assert [o.text for o in outs] == harness.reference()
