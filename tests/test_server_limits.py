"""Server robustness: 429 from the front-end in-flight bound (the derived default: test_http_guards) and from
the scheduler's full queue, a schemathesis run over the OpenAPI schema (in-process ASGI) that must never see a
5xx, and the limits of README "Limits and failure behaviour" against a real engine: a hypothesis fuzz of every
request field with extremes beside a long stream (which must finish whole), a slow reader, oversized bodies,
10,000 stop strings, lone surrogates and the deadline. After each, the engine holds no request and no KV.

The limits engine admits one running and one queued request; the fuzzing engine has a 64-token context, so
every generated request is short; the stress engine runs four requests at once with a 1024-token context, behind
a server whose sockets have a small fixed send buffer (so a stalled reader pushes back after kilobytes).
No answer in these tests may contain a traceback or a source path.
"""

from __future__ import annotations

import contextlib
import json
import socket

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_harness import engine_idle, metrics, uvicorn_server, wait_for

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _engine(model: str, **options):
    from raymoe.client.engine_client import EngineClient
    from raymoe.engine import _split_options

    return EngineClient(_split_options(model, options))


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model):
    e = _engine(tiny_model, max_running_requests=1, max_queued_requests=1, max_context_len=1024)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def fuzz_engine(ray_cluster, tiny_model):
    e = _engine(tiny_model, max_running_requests=2, max_context_len=64)
    yield e
    e.shutdown()


def _start_stream(base_url: str, model: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    data = json.dumps({"model": model, "prompt": "def f(", "max_tokens": 1000, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _post(base_url: str, model: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2},
                      headers=AUTH, timeout=30)


def test_front_end_bound_answers_429(engine):
    from raymoe.deploy.openai_api import build_openai_app

    with uvicorn_server(build_openai_app(engine, api_key=KEY, max_in_flight=1)) as url:
        first = _start_stream(url, engine.model_name)
        wait_for(lambda: metrics(url)["raymoe:num_requests_in_flight"] == 1)
        r = _post(url, engine.model_name)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        first.close()
        wait_for(lambda: engine_idle(url) and metrics(url)["raymoe:num_requests_in_flight"] == 0)
        assert _post(url, engine.model_name).status_code == 200


def test_full_scheduler_queue_answers_429(engine):
    from raymoe.deploy.openai_api import build_openai_app

    # The default front-end bound equals the scheduler's capacity (2 here); raise it to reach the scheduler.
    with uvicorn_server(build_openai_app(engine, api_key=KEY, max_in_flight=10)) as url:
        running = _start_stream(url, engine.model_name)
        wait_for(lambda: metrics(url)["raymoe:num_requests_running"] == 1)
        waiting = _start_stream(url, engine.model_name)
        wait_for(lambda: metrics(url)["raymoe:num_requests_waiting"] == 1)
        r = _post(url, engine.model_name)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        running.close()
        waiting.close()
        wait_for(lambda: engine_idle(url))


@pytest.fixture(scope="module")
def api_schema(fuzz_engine):
    from raymoe.deploy.openai_api import build_openai_app

    return schemathesis.openapi.from_asgi("/openapi.json", build_openai_app(fuzz_engine, api_key=KEY))


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_generated_requests_never_get_a_5xx(api_schema, fuzz_engine, mode):
    # Bodies that fit the schema (positive) and bodies that break it (negative), over every operation.
    strategy = api_schema.as_strategy(schemathesis.GenerationMode(mode))
    seen: dict[int, int] = {}
    model = fuzz_engine.model_name

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(case=strategy)
    def check(case):
        if isinstance(case.body, dict) and "model" in case.body and mode == "positive":
            case.body["model"] = model  # a random model id would only ever reach the 404
        response = case.call(headers=AUTH)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code", "request_id"}

    check()
    assert seen.get(200, 0) > 0 if mode == "positive" else seen.get(400, 0) > 0, seen


# ---------------------------------------------------------------------------------------------------------------
# Limits and failure behaviour under load (README "Limits and failure behaviour"): one engine with room for a few
# concurrent requests and a 1024-token context, so one stream can run long while other requests come and go.

STRESS_LIMITS = {"max_stream_backlog_events": 4, "max_body_bytes": 256 * 1024}


@pytest.fixture(scope="module")
def stress_engine(ray_cluster, tiny_model):
    e = _engine(tiny_model, max_running_requests=4, max_queued_requests=4, max_context_len=1024)
    yield e
    e.shutdown()


@contextlib.contextmanager
def _small_buffer_server(app, sndbuf: int = 16 * 1024):
    """uvicorn on 127.0.0.1 whose connections have a fixed kernel send buffer of ``sndbuf`` bytes (set on the
    listening socket, inherited by accepted ones; no autotuning), so a reader that stops reading pushes back on
    the server after kilobytes, not megabytes."""
    from raymoe.deploy.thread_server import serve_in_thread

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    with serve_in_thread(app, sock=sock, timeout_s=30) as url:
        yield url


@pytest.fixture(scope="module")
def stress_url(stress_engine):
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.deploy.server_config import ServerLimits

    app = build_openai_app(stress_engine, api_key=KEY, limits=ServerLimits(**STRESS_LIMITS))
    with _small_buffer_server(app) as url:
        yield url


def _no_internals(r: httpx.Response) -> None:
    """No answer ever shows a traceback or a source path."""
    assert "Traceback" not in r.text and ".py" not in r.text and 'File "' not in r.text, r.text[:500]


def _well_formed_error(r: httpx.Response) -> dict:
    _no_internals(r)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"} and err["message"], err
    assert err["request_id"] == r.headers["x-request-id"]
    return err


def _events(text: str) -> list:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def _raw_stream(base_url: str, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the TCP window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _read_until_done(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_slow_reader_is_aborted_and_told(stress_url, stress_engine):
    aborted = metrics(stress_url)["raymoe:request_success_total{finish_reason=abort}"]
    body = {"model": stress_engine.model_name, "messages": [{"role": "user", "content": "def f("}],
            "max_tokens": 1000, "logprobs": True, "top_logprobs": 20, "stream": True, "ignore_eos": True}
    sock = _raw_stream(stress_url, "/v1/chat/completions", body, rcvbuf=4096)
    try:
        # The client reads nothing: its window, the kernel buffers and the server's transport fill up, then the
        # backlog passes 4 events and the request is aborted in the engine (its KV freed) while still unread.
        wait_for(lambda: metrics(stress_url)["raymoe:request_success_total{finish_reason=abort}"] == aborted + 1,
                 timeout_s=120)
        wait_for(lambda: engine_idle(stress_url), timeout_s=20)
        data = _read_until_done(sock)
    finally:
        sock.close()
    events = [json.loads(line[6:]) for line in data.decode(errors="replace").split("\r\n")
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "slow_reader", events[-1]
    assert b"data: [DONE]" in data and b"Traceback" not in data


def _post_json(url: str, path: str, content: bytes, **kwargs) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def test_oversized_bodies_get_413_and_unauthenticated_ones_401_first(stress_url, stress_engine):
    big = json.dumps({"model": stress_engine.model_name, "prompt": "x" * 300_000}).encode()
    r = _post_json(stress_url, "/v1/completions", big)
    assert r.status_code == 413 and _well_formed_error(r)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit applies while the body streams in
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = _post_json(stress_url, "/v1/completions", chunked())
    assert r.status_code == 413 and "content-length" not in r.request.headers
    _well_formed_error(r)
    r = httpx.post(f"{stress_url}/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 401 and _well_formed_error(r)["code"] == "invalid_api_key"
    assert engine_idle(stress_url)


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["y" * 600]}, "stop"),
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages"),
])
def test_stop_string_caps_and_lone_surrogates_are_400(stress_url, stress_engine, path, extra, param):
    content = json.dumps({"model": stress_engine.model_name, **extra}).encode()
    r = _post_json(stress_url, path, content)
    assert r.status_code == 400, r.text
    assert _well_formed_error(r)["param"] == param
    assert engine_idle(stress_url)


def test_deadline_aborts_the_request_in_the_engine(stress_url, stress_engine):
    aborted = metrics(stress_url)["raymoe:request_success_total{finish_reason=abort}"]
    body = {"model": stress_engine.model_name, "prompt": "def f(", "max_tokens": 1000, "ignore_eos": True,
            "timeout": 0.5}
    r = _post_json(stress_url, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 408 and _well_formed_error(r)["code"] == "request_timeout"
    r = _post_json(stress_url, "/v1/completions", json.dumps({**body, "stream": True}).encode())
    assert r.status_code == 200
    _no_internals(r)
    events = _events(r.text)
    assert events[-1]["error"]["code"] == "request_timeout"
    assert events[-1]["error"]["request_id"] == r.headers["x-request-id"]
    wait_for(lambda: engine_idle(stress_url), timeout_s=20)
    assert metrics(stress_url)["raymoe:request_success_total{finish_reason=abort}"] == aborted + 2


# Field values for the fuzz: extremes of every type, a few valid values, and values of the wrong type. Valid
# max_tokens are small so every accepted request is short.
_INTS = [-2**63 - 1, -2**63, -1, 0, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64]
_FLOATS = [float("nan"), float("inf"), float("-inf"), -1e-300, 0.0, 0.5, 1.0, 2.0, 2.5, 1e308]
_JUNK = [None, True, "1", [], {}, [[1]], "\ud800"]


def _fuzz_fields(vocab: int) -> dict:
    from hypothesis import strategies as st

    def one_of(*values):
        return st.sampled_from([v for group in values for v in group])

    numbers = one_of(_INTS, _FLOATS, _JUNK)
    return {
        "max_tokens": one_of([1, 3], [-1, 0, 2**31, 2**63, 2**64, 1.5, float("nan")], _JUNK),
        "temperature": numbers, "top_p": numbers, "min_p": numbers, "top_k": numbers, "seed": numbers,
        "presence_penalty": numbers, "frequency_penalty": numbers, "repetition_penalty": numbers, "n": numbers,
        "best_of": numbers,
        "stop": one_of([["a"] * 10_000, ["x" * 600], [""], ["\ud800"], "ok", ["\n"], [[1]], 3], _JUNK),
        "stop_token_ids": one_of([[1], [-1], [2**63], [vocab], [1] * 5000, "x"], _JUNK),
        "ignore_eos": one_of([True, False, 2, "no"]),
        "stream": one_of([True, False, "yes"]),
        "stream_options": one_of([{"include_usage": True}, {"include_usage": "x"}, 5]),
        "logit_bias": one_of([{"1": 100}, {"x": float("nan")}, {"\ud800": 1}]),
        "user": one_of(["x" * 300, "\ud800", "me"]),
        "timeout": one_of([0.001, 0, -1, float("nan"), float("inf"), 3601, 1e308, 2**63, "1"]),
        "echo": one_of([True, False]), "suffix": one_of(["s", ""]), "tools": one_of([[{}], []]),
    }


def _fuzz_bodies(model: str, vocab: int):
    from hypothesis import strategies as st

    fields = _fuzz_fields(vocab)
    prompts = st.sampled_from(["hello", "", "\ud800", [1, 2, 3], [[1, 2]], [[[1]]], [-1], [2**63], [vocab],
                               ["a", "b"], list(range(1200)), "word " * 1200, [0], None, 7])
    messages = st.sampled_from([[], [{"role": "user", "content": "hi"}], [{"role": "wizard", "content": "x"}],
                                [{"role": "user", "content": "\ud800"}],
                                [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                [{"role": "user", "content": None}] * 5000, "hello", [{"content": 3}]])
    chat_only = {"logprobs": st.sampled_from([True, False, 1, "yes"]),
                 "top_logprobs": st.sampled_from([0, 20, 21, -1, 2**63, None]),
                 "max_completion_tokens": st.sampled_from([1, 2, 0, -5, 2**63, float("inf")])}
    completion_only = {"logprobs": st.sampled_from([0, 5, 20, 21, -1, 2**63, True])}
    completion = st.fixed_dictionaries({"model": st.just(model), "prompt": prompts},
                                       optional={**fields, **completion_only})
    # Chat always sends max_tokens (a chat request without it may use the whole context): small or extreme.
    chat_max_tokens = st.sampled_from([1, 2, -1, 0, 2**31, 2**63, 2**64, 1.5, float("nan"), "1", True])
    chat = st.fixed_dictionaries({"model": st.just(model), "messages": messages, "max_tokens": chat_max_tokens},
                                 optional={**{k: v for k, v in fields.items() if k != "max_tokens"}, **chat_only})
    return st.one_of(st.tuples(st.just("/v1/completions"), completion),
                     st.tuples(st.just("/v1/chat/completions"), chat))


def test_fuzzed_requests_never_hurt_a_running_stream(stress_url, stress_engine):
    import threading

    from hypothesis import given, settings

    model, long_tokens = stress_engine.model_name, 600
    long_body = {"model": model, "prompt": "def f(", "max_tokens": long_tokens, "ignore_eos": True,
                 "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    long_result: dict = {}
    # the long stream's text run undisturbed, before the fuzzing (greedy: the same tokens beside any other requests)
    alone = httpx.post(f"{stress_url}/v1/completions", json={**long_body, "stream": False, "stream_options": None},
                       headers=AUTH, timeout=300)
    want = alone.json()["choices"][0]["text"]

    def long_stream() -> None:
        with httpx.stream("POST", f"{stress_url}/v1/completions", json=long_body, headers=AUTH, timeout=300) as r:
            long_result["status"] = r.status_code
            long_result["text"] = r.read().decode()

    reader = threading.Thread(target=long_stream, daemon=True)
    reader.start()
    wait_for(lambda: metrics(stress_url)["raymoe:num_requests_running"] >= 1, timeout_s=30)
    seen: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(case=_fuzz_bodies(model, stress_engine.model_config.vocab_size))
    def check(case):
        path, body = case
        r = _post_json(stress_url, path, json.dumps(body).encode())  # NaN/Infinity as the JSON literals
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (path, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            _well_formed_error(r)
        elif r.headers["content-type"].startswith("text/event-stream"):
            _no_internals(r)
            for event in _events(r.text):
                assert "error" not in event or set(event["error"]) >= {"message", "type", "request_id"}

    check()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
    reader.join(timeout=300)
    assert long_result["status"] == 200
    events = _events(long_result["text"])
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    assert events[-1]["usage"]["completion_tokens"] == long_tokens
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want  # its own tokens, all of them
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    wait_for(lambda: engine_idle(stress_url), timeout_s=20)
