"""Several front ends per engine (``raymoe.actors.frontends``, ``EngineClient.attach``).

Unit: request ids carry their front end's id; an output batch splits by owner row for row; a publisher with one
front end sends it everything, with several each its own rows, keeps rows published before any front end connected
and drops a front end's rows once it is gone.

On the session cluster, one dp=2 engine per group-scheduler placement (the driver's process; one process per DP
group, which then publishes straight to each front end): a second front end attaches by name; both stream the same
caller ids at once and get the greedy tokens the engine gives alone; each front end's reader receives rows of its
own requests only; a front end that leaves with requests in flight has them aborted (the engine goes idle with
nothing leaked) while the other keeps serving; attaching to an unknown name and an id holding the separator are
refused.
"""

from __future__ import annotations

import asyncio
import uuid
from multiprocessing import Pipe

import pytest
from server_harness import wait_for

from raymoe.actors.frontends import FRONTEND_SEP, OutputFanout, engine_request_id, frontend_of
from raymoe.actors.output_batch import OutputBatch, RequestEnd
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.step_output import TokenLogprobs


def test_request_ids_carry_their_front_end():
    assert engine_request_id("", "r1") == "r1" and frontend_of("r1") == ""
    rid = engine_request_id("fe2", "r1")
    assert rid == f"fe2{FRONTEND_SEP}r1" and frontend_of(rid) == "fe2"


def _batch() -> OutputBatch:
    b = OutputBatch()
    b.add("a", [1, 2], 2)
    b.add(engine_request_id("x", "b"), [3], 1, [TokenLogprobs(-0.5, [3], [-0.5])])
    b.end(engine_request_id("x", "c"), RequestEnd(finish_reason="abort"))
    b.add("d", [4], 3, end=RequestEnd(finish_reason="length", prompt_tokens=5))
    return b


def test_a_batch_splits_by_owner_row_for_row():
    batch = _batch()
    parts = batch.split(frontend_of)
    assert sorted(parts) == ["", "x"]
    assert [(d.request_id, d.token_ids, d.finished) for d in parts[""]] == [("a", [1, 2], False), ("d", [4], True)]
    mine = list(parts["x"])
    assert mine[0].logprobs[0].logprob == -0.5 and mine[1].finish_reason == "abort" and mine[1].finished
    whole = {d.request_id: d for d in batch}
    assert all(d == whole[d.request_id] for part in parts.values() for d in part)


def test_a_fanout_sends_each_front_end_its_own_rows():
    def send(conn, batch):
        conn.send(batch)

    fanout = OutputFanout(send)
    fanout.publish(_batch())  # nobody connected yet: kept
    a_r, a_w = Pipe(duplex=False)
    assert fanout.connect("", a_w) is None
    assert len(a_r.recv()) == 4  # the early rows, all to the only front end
    fanout.publish(_batch())
    assert len(a_r.recv()) == 4
    x_r, x_w = Pipe(duplex=False)
    fanout.connect("x", x_w)
    fanout.publish(_batch())
    assert a_r.recv().rids == ["a", "d"]
    assert x_r.recv().rids == [engine_request_id("x", "b"), engine_request_id("x", "c")]
    assert not fanout.drop("x", a_w) and fanout.drop("x", x_w) and fanout.frontends == [""]
    fanout.connect("y", Pipe(duplex=False)[1])
    fanout.publish(_batch())  # x is gone: its rows are dropped, the others still arrive
    assert a_r.recv().rids == ["a", "d"] and not x_r.poll(0.1)


# ---------------------------------------------------------------------------------------------- on the cluster
PROMPTS = [[5 + (7 * i + j) % 90 for j in range(6 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module", params=["driver", "actors"])
def engines(request, ray_cluster, tiny_model):
    from raymoe.client.engine_client import EngineClient
    from raymoe.config import engine_config_from_options

    name = f"fe-{request.param}-{uuid.uuid4().hex[:6]}"
    config = engine_config_from_options(tiny_model, {"dp_size": 2, "ep_size": 2, "max_running_requests": 16,
                                                     "max_total_tokens": 4096, "max_context_len": 512,
                                                     "group_schedulers": request.param})
    first = EngineClient(config, engine_name=name)
    try:
        second = EngineClient.attach(name, frontend_id="second")
        yield first, second
        second.shutdown()
    finally:
        first.shutdown()


def _recorded(client) -> list[str]:
    """Every request id of the rows ``client``'s reader receives from now on."""
    seen: list[str] = []
    route = client._route

    def recording(batch):
        seen.extend(batch.rids)
        route(batch)

    client._route = recording
    return seen


async def _tokens(client, rid: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    out = []
    async for delta in client.generate(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True)):
        assert delta.request_id == rid
        out += delta.token_ids
    return out


def _idle(client) -> None:
    import ray

    def idle_stats():
        s = ray.get(client.driver.stats.remote(), timeout=30)
        return s if s.idle_checked and s.num_running == s.num_waiting == 0 else None

    s = wait_for(idle_stats, timeout_s=60, interval_s=0.2)
    assert (s.kv_leaked_slots, s.req_rows_leaked, s.cache_tokens_locked) == (0, 0, 0), s


def test_two_front_ends_stream_the_same_ids_and_each_gets_only_its_rows(engines):
    import ray

    first, second = engines
    assert sorted(ray.get(first.driver.frontends.remote(), timeout=30)) == ["", "second"]
    alone = asyncio.run(_tokens(first, "solo", PROMPTS[0]))
    seen_first, seen_second = _recorded(first), _recorded(second)

    async def both():
        jobs = [_tokens(c, f"r{i}", p) for c in (first, second) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*jobs)

    outs = asyncio.run(both())
    n = len(PROMPTS)
    assert outs[:n] == outs[n:] and outs[0] == alone  # the same caller ids on both, the tokens of a lone run
    assert seen_first and all(frontend_of(rid) == "" for rid in seen_first)
    assert seen_second and all(frontend_of(rid) == "second" for rid in seen_second)
    _idle(first)


def test_a_front_end_that_leaves_has_its_requests_aborted(engines, tiny_model):
    import ray

    from raymoe.client.engine_client import EngineClient

    first, _ = engines
    leaving = EngineClient.attach(first.engine_name, frontend_id="leaving")

    async def start_and_leave():
        async def consume(i):
            async for _ in leaving.generate(f"long{i}", PROMPTS[i], SamplingParams(max_tokens=400, temperature=0.0,
                                                                                     ignore_eos=True)):
                pass

        def running():
            s = ray.get(first.driver.stats.remote(), timeout=30)
            return s if s.num_running >= 4 else None

        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        await asyncio.sleep(0.05)  # each task sent its request
        steps = (await asyncio.to_thread(wait_for, running, timeout_s=60, interval_s=0.1)).num_steps
        leaving.shutdown()  # the process would exit here: its channel closes with its requests in flight
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return steps

    left_at = asyncio.run(start_and_leave())
    _idle(first)  # KV freed, nothing locked
    # Aborted, not run to the end: 400 tokens each would have taken about 400 more steps.
    assert ray.get(first.driver.stats.remote(), timeout=30).num_steps - left_at < 200
    assert "leaving" not in ray.get(first.driver.frontends.remote(), timeout=30)
    assert asyncio.run(_tokens(first, "after", PROMPTS[1], 4))


def test_attaching_to_an_unknown_engine_and_ids_with_the_separator_are_refused(engines):
    from raymoe.client.engine_client import EngineClient

    first, _ = engines
    with pytest.raises(ValueError):
        EngineClient.attach("no-such-engine")
    with pytest.raises(ValueError, match="frontend_id"):
        EngineClient.attach(first.engine_name, frontend_id=f"a{FRONTEND_SEP}b")

    async def bad():
        async for _ in first.generate(f"x{FRONTEND_SEP}y", PROMPTS[0], SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(ValueError, match="separates front-end ids"):
        asyncio.run(bad())


def test_raymoe_serve_attach_serves_the_engine_over_http(engines, tiny_model):
    """``ServeOptions(attach=NAME)`` (``raymoe serve --attach NAME``) builds an attached front end: its OpenAI app
    answers the engine's greedy text; starting an engine and attaching are exclusive."""
    import httpx
    from pydantic import ValidationError
    from server_harness import uvicorn_server

    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.deploy.server_config import ServeOptions

    first, _ = engines
    want = asyncio.run(_tokens(first, "http-ref", PROMPTS[2], 8))
    with pytest.raises(ValidationError, match="attach: an attached front end starts no engine"):
        ServeOptions(attach=first.engine_name, engine_name="other")
    front = ServeOptions(attach=first.engine_name, served_model_name="tiny").engine_client()
    try:
        assert front.frontend_id and front.config.model == tiny_model
        with uvicorn_server(build_openai_app(front)) as url:
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == front.tokenizer.decode(want, skip_special_tokens=True)
    finally:
        front.shutdown()
