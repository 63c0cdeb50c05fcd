"""The drain of the HTTP front end, in process and without Ray: the real FastAPI app over the fake engine of
``test_http_guards`` (tokens on a timer), driven through httpx's ASGI transport while ``Drain.run`` runs on the
same loop; and the signal handling of ``DrainingServer``.

Covers: new API requests refused with 503 ``server_shutdown`` and ``Retry-After`` while probes keep answering
(``/ready`` and ``/health`` 503 ``draining``, ``/live`` 200); streams that finish within the timeout end normally;
streams still running at the deadline end with one ``server_shutdown`` error event and ``[DONE]`` (and are
aborted in the engine); a request whose answer had not started gets the 503; readiness follows engine health.
"""

from __future__ import annotations

import asyncio
import json
import signal

import anyio
import pytest
from test_http_guards import AUTH, FakeEngine, _app, _client

from raymoe.deploy.drain_config import DrainConfig
from raymoe.errors import InvalidRequestError


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from raymoe.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def _body(max_tokens: int, stream: bool = True) -> dict:
    return {"model": "fake", "prompt": "def f(x):", "max_tokens": max_tokens, "stream": stream}


def _events(text: str) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


def _drain_app(engine, **drain):
    app = _app(engine)
    app.state.drain.config = DrainConfig(**drain)
    return app


def test_drain_config_checks_its_fields():
    with pytest.raises(InvalidRequestError) as e:
        DrainConfig(shutdown_timeout_s=0)
    assert e.value.field == "shutdown_timeout_s"
    with pytest.raises(InvalidRequestError) as e:
        DrainConfig(retry_after_s=1.5)
    assert e.value.field == "retry_after_s"


def test_stop_flags_reach_the_drain_config():
    from raymoe.cli import build_parser
    from raymoe.deploy.cli import drain_from_args

    cfg = drain_from_args(build_parser().parse_args(["serve", "--shutdown-timeout", "2", "--retry-after-s", "1"]))
    assert (cfg.shutdown_timeout_s, cfg.retry_after_s, cfg.cut_grace_s) == (2.0, 1, DrainConfig().cut_grace_s)
    assert drain_from_args(build_parser().parse_args(["serve"])) == DrainConfig()
    with pytest.raises(InvalidRequestError, match="shutdown_timeout_s"):
        drain_from_args(build_parser().parse_args(["serve", "--shutdown-timeout", "-1"]))


def test_streams_that_finish_in_time_end_normally_and_new_requests_are_refused(tokenizer):
    engine = FakeEngine(tokenizer, delay_s=0.01)
    app = _drain_app(engine, shutdown_timeout_s=20.0)

    async def main():
        async with _client(app) as c:
            streams = [asyncio.create_task(c.post("/v1/completions", json=_body(60), headers=AUTH))
                       for _ in range(4)]
            while len(engine.open) < 4:
                await asyncio.sleep(0.01)
            drain = asyncio.create_task(app.state.drain.run())
            await asyncio.sleep(0)
            refused = await c.post("/v1/completions", json=_body(2), headers=AUTH)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            err = refused.json()["error"]
            assert err["code"] == "server_shutdown" and err["request_id"] == refused.headers["x-request-id"]
            assert (await c.get("/v1/models", headers=AUTH)).status_code == 503
            for route in ("/ready", "/health"):
                r = await c.get(route)
                assert r.status_code == 503 and r.json()["status"] == "draining", r.text
                assert r.json()["error"]["code"] == "server_shutdown"
            live = await c.get("/live")
            assert live.status_code == 200 and live.json() == {"status": "draining"}
            assert not drain.done()  # the streams are still running
            answers = await asyncio.gather(*streams)
            report = await drain
        for r in answers:
            events = _events(r.text)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert (report.in_flight, report.finished, report.cut, report.refused) == (4, 4, 0, 2)

    anyio.run(main)
    assert not engine.open


def test_streams_left_at_the_deadline_end_with_a_shutdown_event(tokenizer):
    engine = FakeEngine(tokenizer, delay_s=0.01)
    app = _drain_app(engine, shutdown_timeout_s=0.5)

    async def main():
        async with _client(app) as c:
            streams = [asyncio.create_task(c.post("/v1/completions", json=_body(2000), headers=AUTH))
                       for _ in range(3)]
            while len(engine.open) < 3:
                await asyncio.sleep(0.01)
            started = anyio.current_time()
            report = await app.state.drain.run()
            assert 0.5 <= anyio.current_time() - started < 5
            answers = await asyncio.gather(*streams)
        assert (report.in_flight, report.finished, report.cut) == (3, 0, 3)
        for r in answers:
            assert r.status_code == 200
            events = _events(r.text)
            assert events[-1] == "[DONE]"
            err = events[-2]["error"]
            assert err["code"] == "server_shutdown" and err["type"] == "service_unavailable_error"
            assert err["request_id"] == r.headers["x-request-id"] and "0.5 s" in err["message"]
            tokens = [e for e in events[:-2] if e["choices"][0]["text"]]
            assert 0 < len(tokens) < 2000
            assert not any("error" in e for e in events[:-2])

    anyio.run(main)
    assert not engine.open  # cut streams were aborted in the engine


def test_a_request_without_an_answer_at_the_deadline_gets_503(tokenizer):
    engine = FakeEngine(tokenizer)
    engine.gate = asyncio.Event()  # generation never starts: the request waits for its first token
    app = _drain_app(engine, shutdown_timeout_s=0.3)

    async def main():
        async with _client(app) as c:
            waiting = [asyncio.create_task(c.post("/v1/completions", json=_body(5, stream=s), headers=AUTH))
                       for s in (True, False)]
            while len(engine.open) < 2:
                await asyncio.sleep(0.01)
            report = await app.state.drain.run()
            for r in await asyncio.gather(*waiting):
                assert r.status_code == 503 and r.headers["retry-after"] == "5"
                assert r.json()["error"]["code"] == "server_shutdown"
        assert (report.in_flight, report.cut) == (2, 2)

    anyio.run(main)
    assert not engine.open


def test_readiness_follows_engine_health_and_liveness_does_not(tokenizer):
    engine = FakeEngine(tokenizer)
    app = _app(engine)

    async def main():
        async with _client(app) as c:
            for route in ("/ready", "/health", "/live"):
                r = await c.get(route)
                assert r.status_code == 200 and r.json() == {"status": "ok"}, route
            engine.healthy = _unhealthy
            for route in ("/ready", "/health"):
                r = await c.get(route)
                assert r.status_code == 503 and r.json()["status"] == "unhealthy"
                assert r.json()["error"]["code"] == "engine_unhealthy"
            assert (await c.get("/live")).status_code == 200

    anyio.run(main)


async def _unhealthy() -> bool:
    return False


def test_first_signal_drains_a_second_cuts_it_short_a_third_drops():
    import uvicorn

    from raymoe.deploy.drain import Drain
    from raymoe.deploy.shutdown import DrainingServer

    async def main():
        drain = Drain(DrainConfig(shutdown_timeout_s=5.0))
        server = DrainingServer(uvicorn.Config(app=None), drain)
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGTERM, None)
        assert drain.draining and not server.should_exit
        for _ in range(20):  # the drain task runs on the loop; with nothing in flight it ends at once
            await asyncio.sleep(0.01)
        assert server.should_exit and not server.force_exit and not server.forced
        assert server.report is not None and server.report.in_flight == 0

        drain = Drain(DrainConfig(shutdown_timeout_s=60.0, cut_grace_s=0.2))
        server = DrainingServer(uvicorn.Config(app=None), drain)
        server._loop = asyncio.get_running_loop()
        drain._enter()  # a request in flight keeps the drain going (its scope is never entered: it stays)
        server.handle_exit(signal.SIGINT, None)
        await asyncio.sleep(0.05)
        assert drain.draining and not server.should_exit
        server.handle_exit(signal.SIGINT, None)  # second: cut now instead of after 60 s
        assert server.forced and not server.force_exit
        for _ in range(100):
            await asyncio.sleep(0.01)
            if server.should_exit:
                break
        assert server.should_exit and not server.force_exit and drain.hurried
        assert (server.report.in_flight, server.report.cut, server.report.hurried) == (1, 1, True)
        assert "when told to stop at once" in server.report.summary()
        server.handle_exit(signal.SIGINT, None)  # third: drop
        assert server.force_exit

    asyncio.run(main())
