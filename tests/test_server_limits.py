"""Server robustness: 429 from the front-end in-flight bound and from the scheduler's full queue, and a
schemathesis run over the OpenAPI schema (in-process ASGI) that must never see a 5xx.

The limits engine admits one running and one queued request; the fuzzing engine has a 64-token context, so
every generated request is short.
"""

from __future__ import annotations

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
    from raymoe.deploy.engine_client import EngineClient
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
