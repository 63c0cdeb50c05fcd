"""The real thing: the Ray Serve app (``serve_app.build_app``) on the session cluster, one replica holding a
``EngineClient`` whose driver actor runs dp=2 x ep=2 rank actors in placement groups, answering a streaming
chat completion from the official ``openai`` client through the Serve proxy on 127.0.0.1."""

from __future__ import annotations

import httpx
import pydantic
import pytest
from openai import OpenAI
from server_harness import metrics

from raymoe.cluster.bootstrap import free_port

KEY = "serve-key"


def test_build_app_validates_args_and_returns_an_application():
    from ray.serve import Application

    from raymoe.deploy.serve_app import build_app

    assert isinstance(build_app({"dp_size": 2, "tp_size": 1, "enable_tbo": True}), Application)
    assert isinstance(build_app(), Application)
    with pytest.raises(pydantic.ValidationError):
        build_app({"dp_sizes": 2})
    with pytest.raises(pydantic.ValidationError):
        build_app({"dp_size": 0})


@pytest.fixture(scope="module")
def serve_url(ray_cluster, tiny_model):
    from ray import serve

    from raymoe.deploy.serve_app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = build_app({"model": tiny_model, "served_model_name": "tiny-moe", "dp_size": 2, "ep_size": 2,
                     "enable_tbo": True, "max_running_requests": 8, "api_key": KEY})
    serve.run(app, name="raymoe", route_prefix="/", blocking=False)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def test_streaming_chat_through_ray_serve_on_dp2_ep2_ranks(serve_url):
    import ray

    client = OpenAI(base_url=f"{serve_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "def fib(n):"}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    full = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "def fib(n):"}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.content == text

    # The ranks sit in one placement group per TP group (dp=2, tp=1: two groups of one bundle).
    pgs = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"
           and pg["name"].startswith("raymoe-tp")]
    assert len(pgs) == 2 and all(len(pg["bundles"]) == 1 for pg in pgs)

    m = metrics(serve_url)
    assert m["raymoe:request_success_total{finish_reason=length}"] == 2
    assert m["raymoe:num_requests_running"] == 0 and m["raymoe:kv_cache_usage_perc"] == 0
    assert httpx.get(f"{serve_url}/health").status_code == 200
    assert httpx.get(f"{serve_url}/v1/models").status_code == 401


def test_a_pd_app_beside_it_answers_what_the_colocated_app_answers(serve_url, tiny_model):
    """The Serve app config's ``pd_prefill`` / ``pd_decode``: a second application (a prefill engine dp=1 and a
    decode engine dp=2 x ep=2 behind one replica) gives the same greedy text as the colocated dp=2 x ep=2 app, whole
    whole, and deleting it releases the decode engine's rank placement groups."""
    import time

    import ray
    from ray import serve

    from raymoe.deploy.serve_app import build_app

    def rank_groups() -> int:
        return sum(1 for pg in ray.util.placement_group_table().values()
                   if pg["state"] == "CREATED" and pg["name"].startswith("raymoe-tp"))

    body = {"model": "tiny-moe", "prompt": "def fib(n):\n    return", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    want = httpx.post(f"{serve_url}/v1/completions", json=body, headers=headers, timeout=120)
    assert want.status_code == 200, want.text
    before = rank_groups()
    app = build_app({"model": tiny_model, "served_model_name": "tiny-moe", "pd_prefill": "dp=1",
                     "pd_decode": "dp=2,ep=2", "enable_tbo": True, "max_running_requests": 8, "api_key": KEY})
    serve.run(app, name="pd", route_prefix="/pd", blocking=False)
    try:
        deadline = time.monotonic() + 240
        while serve.status().applications["pd"].status != "RUNNING":
            assert time.monotonic() < deadline, serve.status().applications["pd"].message
            time.sleep(0.5)
        got = httpx.post(f"{serve_url}/pd/v1/completions", json=body, headers=headers, timeout=120)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        assert got.json()["usage"]["completion_tokens"] == 12
        assert rank_groups() == before + 2  # the decode engine's two TP groups (the prefill rank is its driver's)
    finally:
        serve.delete("pd")
    deadline = time.monotonic() + 60
    while rank_groups() != before:
        assert time.monotonic() < deadline, "the PD app's rank placement groups outlived it"
        time.sleep(0.5)


def test_structured_output_through_ray_serve(serve_url):
    """``response_format`` with a pydantic model (``chat.completions.parse``) through the Serve proxy to the dp=2 x
    ep=2 ranks with two-batch overlap: every answer validates (the grammar runs on the ranks of either group)."""

    class Point(pydantic.BaseModel):
        label: str = pydantic.Field(max_length=6)
        x: int = pydantic.Field(ge=-9, le=9)
        ok: bool

    client = OpenAI(base_url=f"{serve_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    for seed in range(4):
        r = client.chat.completions.parse(model="tiny-moe", messages=[{"role": "user", "content": f"p{seed}"}],
                                          response_format=Point, temperature=1.0, seed=seed, max_tokens=80)
        assert isinstance(r.choices[0].message.parsed, Point) and r.choices[0].finish_reason == "stop"
