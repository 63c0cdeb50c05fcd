"""Prefill/decode disaggregation on the session cluster (``raymoe.client.pd_client``): a prefill engine (dp=1) and a
decode engine (dp=2 x ep=2, TBO and decode graphs on), each its own driver actor and ranks, the prompt's KV moved
rank to rank (NIXL where installed, else gloo), Qwen3-MoE and DeepSeek-V3 (MLA: latent rows only).

Checked: greedy streams equal the colocated engine's (the same requests on one dp=2 x ep=2 engine), for prompts
long enough to be chunked and for a prompt whose prefix the prefill engine caches; the decode engine received the
KV (it computed only the first token's, its radix counter says so) and no transfer fell back; a transfer that
fails (no such peer; the receiver times out) falls back to a re-prefill and the stream still gives the colocated
tokens, as does one whose decode rank is SIGKILLed mid-transfer (the decode engine restarts its ranks); a client
that leaves during the transfer leaves both sides holding their KV until the transfer calls return, then nothing;
clients that leave at the first token or mid-stream leave both engines idle (no slot reserved or locked, the idle
invariant on both); a prefill rank SIGKILLed mid-transfer costs a pause too; the Engine API in PD mode (with KV
pages of 4 tokens) gives the colocated tokens; ``raymoe serve --pd-prefill --pd-decode`` answers the colocated
engine's text and streams what it answers whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re

import pytest
from server_harness import wait_for

from raymoe.kvcache.kv_transfer import nixl_available
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.grammar import GrammarSpec

PROMPTS = [[5 + i % 90 for i in range(n)] for n in (7, 40, 300)] + [[5 + i % 90 for i in range(300)] + [1, 2, 3]]
OPTIONS = {"max_running_requests": 8, "chunked_prefill_size": 128, "max_total_tokens": 4096,
           "max_context_len": 1024, "enable_tbo": True}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model(request, tmp_path_factory, tiny_model):
    if request.param == "qwen3_moe":
        return tiny_model
    from raymoe.models.checkpoint import make_checkpoint

    return str(make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("pd") / "v3", seed=2, num_layers=3,
                               hidden_size=64, num_experts=8))


@pytest.fixture(scope="module")
def engines(ray_cluster, model):
    from raymoe.client.engine_client import EngineClient
    from raymoe.client.pd_client import PDEngineClient
    from raymoe.client.pd_config import pd_engine_configs
    from raymoe.config import engine_config_from_options

    colocated = EngineClient(engine_config_from_options(model, {**OPTIONS, "dp_size": 2, "ep_size": 2}))
    try:
        pd = PDEngineClient(*pd_engine_configs(model, OPTIONS, "dp=1", "dp=2,ep=2"))
    except BaseException:
        colocated.shutdown()
        raise
    try:
        yield colocated, pd
    finally:
        pd.shutdown()
        colocated.shutdown()


async def _run(engine, rid: str, prompt: list[int], max_tokens: int, stop_after: int | None = None,
               params: SamplingParams | None = None) -> list[int]:
    out: list[int] = []
    gen = engine.generate(rid, prompt, params or SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True))
    try:
        async for delta in gen:
            out += delta.token_ids
            if stop_after is not None and len(out) >= stop_after:
                break
    finally:
        await gen.aclose()
    return out


@contextlib.contextmanager
def _failing_transfers(pd, timeout_s: float):
    """Transfers in the block fail after ``timeout_s``: the prefill ranks send to an agent that does not exist and
    the decode ranks wait for rows that never come (the agents are started again first if a transfer failed before,
    so the block's own names are the ones in use)."""
    asyncio.run(pd._reconnect_if_stale())
    ranks = pd._decode_ranks
    pd.transfer_timeout_s, pd._decode_ranks = timeout_s, ["nobody"] * len(ranks)
    try:
        yield
    finally:
        pd.transfer_timeout_s, pd._decode_ranks = 30.0, ranks


def _idle(engine) -> None:
    """Wait until the engine reports its idle invariant, and check it (nothing leaked, nothing locked)."""
    import ray

    def idle_stats():
        s = ray.get(engine.driver.stats.remote(), timeout=30)
        return s if s.idle_checked and s.num_running == s.num_waiting == 0 else None

    s = wait_for(idle_stats, timeout_s=30, interval_s=0.2)  # TimeoutError: the engine never became idle
    assert (s.kv_leaked_slots, s.req_rows_leaked, s.cache_tokens_locked) == (0, 0, 0), s


def test_pd_streams_equal_the_colocated_engines(engines):
    import ray

    colocated, pd = engines
    hits = ray.get(pd.decode.driver.stats.remote(), timeout=30).radix_hit_tokens

    async def main():
        want = await asyncio.gather(*(_run(colocated, f"c{i}", p, 24) for i, p in enumerate(PROMPTS)))
        got = await asyncio.gather(*(_run(pd, f"p{i}", p, 24) for i, p in enumerate(PROMPTS)))
        again = await _run(pd, "again", PROMPTS[3], 24)  # its 300-token prefix is cached on the prefill side now
        return want, got, again

    want, got, again = asyncio.run(main())
    assert got == want and again == want[3]
    assert pd.transfers_failed == 0
    if nixl_available():  # written layer by layer while the prefill computed (chunks of 128, a radix hit)
        assert pd.kv_streaming and pd.streamed == len(PROMPTS) + 1, pd.streamed
    # The decode engine found every prompt's KV in its cache: it computed only the first tokens' KV.
    received = ray.get(pd.decode.driver.stats.remote(), timeout=30).radix_hit_tokens - hits
    assert received >= sum(map(len, PROMPTS)) + len(PROMPTS[3]), received
    _idle(pd.prefill)
    _idle(pd.decode)


def test_a_transfer_that_fails_falls_back_to_a_reprefill(engines):
    colocated, pd = engines
    want = asyncio.run(_run(colocated, "t-ref", PROMPTS[2], 16))
    failed = pd.transfers_failed
    with _failing_transfers(pd, 0.5):
        got = asyncio.run(_run(pd, "t-pd", PROMPTS[2], 16))
    assert got == want and pd.transfers_failed == failed + 1
    _idle(pd.prefill)
    _idle(pd.decode)


def test_a_client_that_leaves_during_the_transfer_frees_both_sides_once_the_transfer_calls_return(engines):
    """The transfer is held in flight (the prefill ranks send to an agent that does not exist, the decode ranks wait
    2 s for rows that never come); the client leaves meanwhile. The reservation must outlive the transfer calls (a
    late write must not land in slots another request got) and then be freed, as the prefill side's lock."""
    import ray

    _, pd = engines

    async def main():
        first = asyncio.Event()

        async def consume():
            gen = pd.generate("leave-transfer", PROMPTS[2], SamplingParams(max_tokens=50, temperature=0.0,
                                                                         ignore_eos=True))
            async for _ in gen:
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        await asyncio.sleep(0.3)  # inside the transfer now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)
        # No request runs on either side, but the reservation and the export are still held: neither engine is
        # idle until the transfer calls return.
        for engine in (pd.decode, pd.prefill):
            stats = ray.get(engine.driver.stats.remote(), timeout=30)
            assert stats.num_running == stats.num_waiting == 0 and not stats.idle_checked
        await asyncio.sleep(3.0)  # the transfer calls time out; the clean-up frees both sides

    with _failing_transfers(pd, 2.0):
        asyncio.run(main())
    _idle(pd.prefill)
    _idle(pd.decode)


def _stream_through_a_kill(pd, rid: str, pid: int) -> list[int]:
    """Stream ``PROMPTS[2]`` through ``pd`` with its transfer held in flight (``_failing_transfers``), SIGKILL
    process ``pid`` once the first token came, and return every token the stream gave."""
    import os
    import signal

    async def main():
        first, out = asyncio.Event(), []

        async def consume():
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            async for delta in pd.generate(rid, PROMPTS[2], params):
                out.extend(delta.token_ids)
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(task, timeout=180)
        return out

    with _failing_transfers(pd, 3.0):  # the transfer stays in flight until the kill
        return asyncio.run(main())


def test_a_decode_rank_killed_mid_transfer_costs_the_stream_a_pause(engines):
    """SIGKILL of a decode rank while a request's KV is in flight: the transfer fails, the decode engine restarts
    its ranks, and the request, submitted again to re-prefill there, gives the colocated engine's tokens."""

    import ray

    colocated, pd = engines
    want = asyncio.run(_run(colocated, "kill-ref", PROMPTS[2], 16))
    ranks = ray.get(pd.decode.driver.rank_actors.remote(), timeout=60)
    pid = ray.get(ranks[-1].pid.remote(), timeout=60)
    restarts = ray.get(pd.decode.driver.stats.remote(), timeout=30).rank_restarts

    got = _stream_through_a_kill(pd, "kill", pid)
    assert got == want
    assert ray.get(pd.decode.driver.stats.remote(), timeout=30).rank_restarts == restarts + 1
    # The restarted decode ranks have no agents: the next transfer starts them again and succeeds.
    failed, reconnects = pd.transfers_failed, pd.reconnects
    assert asyncio.run(_run(pd, "after-kill", PROMPTS[2], 16)) == want
    assert pd.transfers_failed == failed and pd.reconnects == reconnects + 1
    _idle(pd.prefill)
    _idle(pd.decode)


def test_a_prefill_rank_killed_mid_transfer_costs_the_stream_a_pause(engines):
    """SIGKILL of the prefill rank while a request's KV is in flight from it: the transfer fails, the decode engine
    re-prefills prompt + first token (the colocated tokens), the prefill engine comes back (its export went with
    it: the release is a no-op there), and the next request's transfer starts the agents again and succeeds. The
    prefill engine here has one rank, which runs in its driver actor's process: the kill takes the driver too, Ray
    restarts the actor and the prefill side's ``EngineClient`` reconnects."""

    import ray

    colocated, pd = engines
    want = asyncio.run(_run(colocated, "pkill-ref", PROMPTS[2], 16))
    assert ray.get(pd.prefill.driver.rank_actors.remote(), timeout=60) == []  # the rank is the driver's process
    pid = ray.get(pd.prefill.driver.pids.remote(), timeout=60)[0]
    failed, driver_reconnects = pd.transfers_failed, pd.prefill.reconnects

    got = _stream_through_a_kill(pd, "pkill", pid)
    assert got == want and pd.transfers_failed == failed + 1
    wait_for(lambda: pd.prefill.reconnects == driver_reconnects + 1, timeout_s=180, interval_s=0.5)
    wait_for(lambda: asyncio.run(pd.prefill.healthy()), timeout_s=120, interval_s=0.5)
    reconnects = pd.reconnects
    assert asyncio.run(_run(pd, "after-pkill", PROMPTS[2], 16)) == want
    assert pd.transfers_failed == failed + 1 and pd.reconnects == reconnects + 1
    _idle(pd.prefill)
    _idle(pd.decode)


def test_the_engine_api_in_pd_mode_gives_the_colocated_tokens(engines, model):
    """``Engine(model, pd_prefill=..., pd_decode=...)``, with KV pages of 4 tokens on both sides (prompts of 7 and
    303 tokens end in a partial page, which moves whole): the same greedy tokens as the colocated engine (one-token
    pages), no transfer fell back, a radix hit on the prefill side; a grammar-constrained request (its first token
    sampled under the grammar on the prefill side, the matcher rebuilt from it on the decode side) gives the
    colocated engine's constrained tokens; both engines idle afterwards; one of the two keywords alone is
    refused."""
    from raymoe.engine import Engine
    from raymoe.errors import InvalidRequestError

    colocated, _ = engines
    with pytest.raises(InvalidRequestError) as e:
        Engine(model, pd_prefill="dp=1", **OPTIONS)
    assert e.value.field == "pd_decode"

    # A prompt of its own, then it extended: the second finds the first's whole pages cached on the prefill side
    # (PROMPTS share prefixes and run together, so their cached paths mix requests' slots inside a page).
    alone = [7 + i % 80 for i in range(200)]

    async def reference():
        return await asyncio.gather(*(_run(colocated, f"e{i}", p, 24) for i, p in enumerate(PROMPTS)),
                                    _run(colocated, "e-alone", alone + [1, 2], 24))

    *want, want_alone = asyncio.run(reference())
    constrained = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                 grammar=GrammarSpec("regex", "[a-z]{4,12}@(foo|bar)\\.(com|org)", field="regex"))
    want_constrained = asyncio.run(_run(colocated, "e-regex", PROMPTS[0], 40, params=constrained))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Engine(model, pd_prefill="dp=1", pd_decode="dp=2,ep=2", page_size=4, **OPTIONS) as engine:
        assert engine.config.cache.page_tokens == engine.pd.prefill.config.cache.page_tokens == 4
        assert engine.config.parallel.dp_size == 2 and engine.pd.prefill.config.parallel.dp_size == 1
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        assert [o.token_ids for o in outs] == want
        assert all(o.finish_reason == "length" and o.prompt_token_ids == p for o, p in zip(outs, PROMPTS, strict=True))
        engine.generate(prompt_token_ids=[alone], sampling_params=dataclasses.replace(params, max_tokens=2))
        again = engine.generate(prompt_token_ids=[alone + [1, 2]], sampling_params=params)[0]
        assert again.token_ids == want_alone and again.cached_tokens == 200 and engine.pd.transfers_failed == 0
        assert engine.pd.streamed == (len(PROMPTS) + 2 if nixl_available() else 0)
        assert outs[0].text == engine.tokenizer.decode(want[0], skip_special_tokens=True)
        got = engine.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=constrained)[0]
        assert got.token_ids == want_constrained and got.finish_reason == "stop"
        assert re.fullmatch("[a-z]{4,12}@(foo|bar)\\.(com|org)", got.text), got.text
        _idle(engine.pd.prefill)
        _idle(engine.pd.decode)


def test_clients_that_leave_leave_both_engines_idle(engines):
    _, pd = engines

    async def main():
        await _run(pd, "leave-decode", PROMPTS[2], 200, stop_after=4)  # leaves while the decode side streams
        await _run(pd, "leave-first", PROMPTS[1], 200, stop_after=1)  # leaves at the prefill's token
        await asyncio.sleep(1.0)  # clean-ups run on the loop after the streams closed

    asyncio.run(main())
    _idle(pd.prefill)
    _idle(pd.decode)


def test_raymoe_serve_with_pd_flags_answers_what_the_colocated_engine_gives(engines, model, request):
    """``raymoe serve --pd-prefill dp=1 --pd-decode dp=2,ep=2`` (its own process and Ray): the greedy text of a
    prompt (as token ids) is the colocated engine's, a streamed completion equals the same request answered whole,
    and the usage counts are the request's. The flags' path does not depend on the model family, and a served
    process costs half a minute: DeepSeek-V3 (MLA's KV pages) runs it; the engine tests above run both."""
    import httpx

    if "qwen3_moe" in request.node.callspec.id:
        pytest.skip("the served PD flags run once, with deepseek_v3")
    from serve_process import serve_process

    from raymoe.tokenizer import load_tokenizer

    colocated, _ = engines
    want = load_tokenizer(model).decode(asyncio.run(_run(colocated, "serve-ref", PROMPTS[1], 12)),
                                        skip_special_tokens=True)
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with serve_process(model, "--pd-prefill", "dp=1", "--pd-decode", "dp=2,ep=2", "--enable-tbo") as server:
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        text = ""
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += "".join(c.get("text") or "" for c in json.loads(line[6:])["choices"])
        usage = whole.json()["usage"]
        assert text == whole.json()["choices"][0]["text"] == want
        assert usage["completion_tokens"] == 12 and usage["prompt_tokens"] == len(PROMPTS[1])
