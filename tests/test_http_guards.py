"""The HTTP front end's guards, in process and without Ray: a fake engine (token ids on demand) behind the real
FastAPI app, driven through httpx's ASGI transport.

Covers what needs no real model: the API key before the body (401 before 413), the body limit for declared and
chunked bodies, request ids in headers and error bodies, the generic 500 (no traceback, no path), lone
surrogates, operator limits (stop strings, timeout), tokenization off the event loop, the deadline and the
slow-reader bound of a stream (the engine request is closed, which is its abort), logprob tokens decoded once,
the relay's backlog, and `raymoe bench frontend` (every stream ends in [DONE]).
"""

from __future__ import annotations

import asyncio
import json
import threading

import anyio
import httpx
import pytest
from fake_engine import FakeEngine

from raymoe.deploy.server_config import ServerLimits
from raymoe.step.step_output import TokenLogprobs

KEY = "guard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from raymoe.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def _app(engine, **limits):
    from raymoe.deploy.openai_api import build_openai_app

    return build_openai_app(engine, api_key=KEY, limits=ServerLimits(**limits))


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test", timeout=30)


def _check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"} and err["message"]
    assert err["request_id"] == r.headers["x-request-id"]
    assert "Traceback" not in r.text and ".py" not in r.text
    if param is not None:
        assert err["param"] == param
    return err


def _run(coro_fn):
    return anyio.run(coro_fn)


def test_api_key_is_checked_before_the_body_is_read(tokenizer):
    engine = FakeEngine(tokenizer)
    app = _app(engine, max_body_bytes=1000)

    async def main():
        async with _client(app) as c:
            big = b"x" * 5000
            # Unauthenticated: 401 even though the body is over the limit (and is never parsed).
            _check_error(await c.post("/v1/completions", content=big), 401)
            _check_error(await c.post("/v1/completions", content=b"{not json"), 401)
            # Authenticated, declared length over the limit: 413 before parsing.
            err = _check_error(await c.post("/v1/completions", content=big, headers=AUTH), 413)
            assert "1000 bytes" in err["message"]

            # Chunked (no Content-Length): cut off while it is read.
            async def chunks():
                for _ in range(10):
                    yield b" " * 400

            r = await c.post("/v1/completions", content=chunks(), headers=AUTH)
            assert "content-length" not in r.request.headers
            _check_error(r, 413)

    _run(main)
    assert not engine.open


def test_unexpected_errors_are_generic_500s_logged_under_the_request_id(tokenizer, caplog):
    engine = FakeEngine(tokenizer)

    async def broken(*args, **kwargs):
        raise RuntimeError('File "/srv/secret/raymoe/engine.py", line 7: boom')
        yield  # an async generator

    engine.generate = broken
    app = _app(engine)

    async def main():
        async with _client(app) as c:
            return await c.post("/v1/completions", json={"model": "fake", "prompt": "x"}, headers=AUTH)

    r = _run(main)
    err = _check_error(r, 500)
    assert err["type"] == "server_error" and "boom" not in r.text and "RuntimeError" not in r.text
    assert any(err["request_id"] in rec.getMessage() and rec.exc_info for rec in caplog.records)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok \udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": "\ud800"}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 513]}, "stop"),
    ("/v1/completions", {"prompt": "x", "timeout": 3601}, "timeout"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_bad_strings_and_operator_limits_are_400s(tokenizer, path, body, param):
    engine = FakeEngine(tokenizer)
    app = _app(engine)
    # json.dumps escapes lone surrogates as \ud800, as a client would send them.
    content = json.dumps({"model": "fake", **body}).encode()

    async def main():
        async with _client(app) as c:
            return await c.post(path, content=content, headers={**AUTH, "Content-Type": "application/json"})

    _check_error(_run(main), 400, param)
    assert not engine.open and not engine.closed  # refused before the engine saw it


class _BlockingTokenizer:
    """The real tokenizer, except that encoding a text starting with "BLOCK" waits until ``release`` is set."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.release = threading.Event()
        self.blocked = threading.Event()

    def encode(self, text, **kwargs):
        if text.startswith("BLOCK"):
            self.blocked.set()
            assert self.release.wait(30), "never released"
        return self._tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


def test_long_prompts_are_tokenized_off_the_event_loop(tokenizer):
    from raymoe.deploy.openai_api import INLINE_PREP_MAX_BODY_BYTES

    blocking = _BlockingTokenizer(tokenizer)
    engine = FakeEngine(blocking)
    app = _app(engine)
    long_prompt = "BLOCK" + " a" * INLINE_PREP_MAX_BODY_BYTES  # a body past the inline bound: a worker thread

    async def main():
        async with _client(app) as c:
            async def slow():
                return await c.post("/v1/completions", json={"model": "fake", "prompt": long_prompt,
                                                             "max_tokens": 3}, headers=AUTH)

            async with anyio.create_task_group() as tg:
                results = {}

                async def run_slow():
                    results["slow"] = await slow()

                tg.start_soon(run_slow)
                await anyio.to_thread.run_sync(blocking.blocked.wait, 30)
                # Tokenization of the long prompt is stuck in a worker thread; the loop still serves a whole stream
                # (its short prompt is prepared on the loop).
                with anyio.fail_after(30):
                    r = await c.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 5,
                                                              "stream": True}, headers=AUTH)
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
                blocking.release.set()
            return results["slow"]

    r = _run(main)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_short_prompts_are_prepared_on_the_loop_without_a_thread(tokenizer, monkeypatch):
    import raymoe.deploy.openai_api as api

    hops = []
    real = anyio.to_thread.run_sync

    async def counting(fn, *args, **kwargs):
        hops.append(getattr(fn, "__name__", fn))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(api.anyio.to_thread, "run_sync", counting)
    app = _app(FakeEngine(tokenizer))

    async def main():
        async with _client(app) as c:
            short = await c.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                                 headers=AUTH)
            hops_after_short = list(hops)
            long = await c.post("/v1/completions", json={"model": "fake", "prompt": "hi " * 1000, "max_tokens": 2},
                                headers=AUTH)
            return short, hops_after_short, long

    short, hops_after_short, long = _run(main)
    assert short.status_code == 200 and long.status_code == 200, (short.text, long.text)
    assert "prepare" not in hops_after_short and hops.count("prepare") == 1


def _sse_events(text: str) -> list:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_deadline_aborts_the_request(tokenizer):
    engine = FakeEngine(tokenizer, delay_s=0.01)
    app = _app(engine)
    body = {"model": "fake", "prompt": "x", "max_tokens": 4000, "timeout": 0.3}

    async def main():
        async with _client(app) as c:
            plain = await c.post("/v1/completions", json=body, headers=AUTH)
            stream = await c.post("/v1/completions", json={**body, "stream": True}, headers=AUTH)
            return plain, stream

    plain, stream = _run(main)
    err = _check_error(plain, 408, "timeout")
    assert err["code"] == "request_timeout"
    events = _sse_events(stream.text)
    assert len(events) > 1 and all("choices" in e for e in events[:-1])
    assert events[-1]["error"]["code"] == "request_timeout"
    assert events[-1]["error"]["request_id"] == stream.headers["x-request-id"]
    assert not engine.open and len(engine.closed) == 2


def test_slow_reader_is_aborted_at_the_backlog_bound(tokenizer):
    from raymoe.deploy.sse import EventRelay, StreamBounds

    closed = []

    async def source():
        try:
            for i in range(100_000):
                await anyio.sleep(0)
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def main():
        bounds = StreamBounds(anyio.current_time() + 60, max_events=8, max_bytes=10_000, backlog_grace_s=0.2,
                              drain_timeout_s=5)
        relay = EventRelay(source(), bounds, "rid")
        received = []

        async def reader():
            # A reader that stops after two events until the producer has given up, then drains.
            async for data in relay.events():
                received.append(data.decode())
                if len(received) == 2:
                    while relay.stopped is None:
                        await anyio.sleep(0.001)

        await relay.run(reader)
        return relay, received

    relay, received = _run(main)
    assert relay.stopped == "slow_reader" and closed == [True]
    assert len(received) <= 2 + 8 + 2
    error = json.loads(received[-2].removeprefix("data: "))["error"]
    assert error["code"] == "slow_reader" and error["request_id"] == "rid"
    assert received[-1] == "data: [DONE]\n\n"


def test_logprob_tokens_are_decoded_once(tokenizer):
    from raymoe.deploy.generation import Piece
    from raymoe.deploy.responses import ResponseBuilder, TokenTexts

    calls = []

    class Counting:
        def decode(self, ids, **kwargs):
            calls.append(tuple(ids))
            return tokenizer.decode(ids, **kwargs)

    texts = TokenTexts(Counting(), len(tokenizer))
    top = list(range(40, 60))
    lp = TokenLogprobs(-0.5, top, [-0.5 - k for k in range(20)])
    for chat in (True, False):
        builder = ResponseBuilder(chat, "fake", texts, 20, "rid")
        for _ in range(3):
            assert builder.chunk(Piece("t", [40], [lp])) is not None
    assert sorted(calls) == sorted({(t,) for t in top})  # each token once, across requests and chunks


def test_the_api_key_is_never_printed():
    from raymoe.deploy.server import curl_example
    from raymoe.deploy.server_config import ServeOptions

    opts = ServeOptions(api_key="s3cret-key")
    assert "s3cret-key" not in repr(opts) and "s3cret-key" not in str(opts)
    line = curl_example("http://127.0.0.1:8000", "m", needs_key=True)
    assert "s3cret-key" not in line and "$RAYMOE_API_KEY" in line
    assert "Authorization" not in curl_example("http://127.0.0.1:8000", "m", needs_key=False)


def test_default_in_flight_bound_is_the_scheduler_capacity(tokenizer):
    engine = FakeEngine(tokenizer)  # dp 1 x (4 running + 4 queued)
    app = _app(engine)
    capacity = 8
    assert app.state.serving.max_in_flight == capacity

    async def main():
        engine.gate = asyncio.Event()
        body = {"model": "fake", "prompt": "x", "max_tokens": 2}
        async with _client(app) as c:
            answers = []

            async def one():
                answers.append(await c.post("/v1/completions", json=body, headers=AUTH))

            async with anyio.create_task_group() as tg:
                for _ in range(capacity):
                    tg.start_soon(one)
                with anyio.fail_after(30):
                    while len(engine.open) < capacity:
                        await anyio.sleep(0.01)
                # Request 1 + max_in_flight: refused by the front end, before the scheduler's queue would.
                r = await c.post("/v1/completions", json=body, headers=AUTH)
                engine.gate.set()
        return r, answers

    r, answers = _run(main)
    assert _check_error(r, 429)["code"] == "too_many_requests"
    assert [a.status_code for a in answers] == [200] * capacity
    assert app.state.serving.in_flight == 0 and not engine.open


def test_backlog_is_fifo_waits_for_events_and_drains_before_it_ends():
    from raymoe.deploy.sse import Backlog

    async def main():
        backlog = Backlog()
        backlog.put(b"a")
        got = [await backlog.get()]
        waiter = asyncio.ensure_future(backlog.get())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing to take: the consumer waits
        backlog.put(b"b")
        got.append(await asyncio.wait_for(waiter, 5))
        backlog.put(b"c")
        backlog.put(b"d")
        backlog.close()  # what was put before the close is still taken, in order, then the end
        got += [await backlog.get(), await backlog.get(), await backlog.get()]
        idle = Backlog()
        cancelled = asyncio.ensure_future(idle.get())
        await asyncio.sleep(0.01)
        assert not cancelled.done()  # a backlog never closed keeps its consumer waiting ...
        cancelled.cancel()  # ... until the response is cancelled (client gone)
        await asyncio.gather(cancelled, return_exceptions=True)
        idle.put(b"late")  # a put after the consumer left is harmless
        return got, cancelled

    got, cancelled = _run(main)
    assert got == [b"a", b"b", b"c", b"d", None]
    assert cancelled.cancelled()


def test_frontend_bench_streams_every_request_to_done(tiny_model):
    from raymoe.bench.frontend import measure

    result = asyncio.run(measure(tiny_model, concurrency=4, requests=12, output_len=8, rounds=2, warmup=4))
    # ``measure`` raises when a stream does not end in [DONE] after at most ``output_len`` chunks.
    assert len(result["us_per_token"]) == 2 and all(v > 0 for v in result["us_per_token"])
