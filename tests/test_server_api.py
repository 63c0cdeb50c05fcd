"""The OpenAI-compatible server through the official ``openai`` client and raw HTTP: completions and chat,
streaming and not, stop strings, seeds, usage, logprobs, 64 concurrent streams, client disconnects, bad input.

One engine (a driver actor whose single rank runs in its process, tiny model) behind uvicorn on 127.0.0.1
serves the whole module.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from openai import OpenAI
from server_harness import engine_idle, metrics, uvicorn_server, wait_for
from stream_check import SwapTwoStreams, assert_distinct, assert_own_outputs

KEY = "test-key"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model):
    from raymoe.client.engine_client import EngineClient
    from raymoe.engine import _split_options

    e = EngineClient(_split_options(tiny_model, {"max_running_requests": 16, "max_context_len": 160}))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def base_url(engine):
    from raymoe.deploy.openai_api import build_openai_app

    with uvicorn_server(build_openai_app(engine, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(engine) -> str:
    return engine.model_name


def test_models_and_health(client, base_url, model):
    assert [m.id for m in client.models.list()] == [model]
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_completion_stream_equals_non_stream_and_usage_counts_tokens(client, engine, model):
    prompt = "def fib(n):"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                     extra_body=NO_EOS)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12 == len(choice.logprobs.tokens)
    assert full.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)

    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_equals_non_stream(client, model):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
    full = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0,
                                          extra_body=NO_EOS)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_sse_ends_with_done(base_url, model):
    body = {"model": model, "prompt": "x = 1", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_stop_strings_cut_text_and_never_stream_a_part(client, model):
    base = client.completions.create(model=model, prompt="class Foo(object):", max_tokens=40, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    k = next(i for i in range(len(base) // 2, len(base) - 3) if "\ufffd" not in base[i:i + 3])
    stop = base[k:k + 3]
    expected = base[:base.find(stop)]
    for stream in (False, True):
        kwargs = {"model": model, "prompt": "class Foo(object):", "max_tokens": 40, "temperature": 0,
                  "stop": [stop, "@@never@@"], "extra_body": NO_EOS}
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**kwargs).choices[0]
            text, reason = out.text, out.finish_reason
        assert text == expected, (stream, stop)
        assert reason == "stop"


def test_seed_gives_identical_samples(client, model):
    def sample(seed):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=16, temperature=0.9, seed=seed,
                                              extra_body=NO_EOS).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_n_choices_are_seeded_apart_and_the_stream_interleaves_them(client, base_url, model):
    """``n=3`` sampled with a seed: three choices, not all alike, the same three again for the same seed, the first
    equal to ``n=1`` with that seed; the stream's text per index equals the whole answer's; greedy choices agree."""
    def answer(n, seed, **kw):
        return client.completions.create(model=model, prompt="def f(", max_tokens=10, temperature=1.0, seed=seed, n=n,
                                         extra_body=NO_EOS, **kw)

    three = answer(3, 77)
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1 and [c.text for c in answer(3, 77).choices] == texts
    assert answer(1, 77).choices[0].text == texts[0]
    assert three.usage.completion_tokens == 30
    streamed = ["", "", ""]
    for chunk in answer(3, 77, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    greedy = client.completions.create(model=model, prompt="def f(", max_tokens=8, temperature=0, n=2,
                                       extra_body=NO_EOS)
    assert greedy.choices[0].text == greedy.choices[1].text
    wait_for(lambda: engine_idle(base_url), timeout_s=30, interval_s=0.05)


def test_logit_bias_and_penalties_reach_the_ranks(client, model):
    """Through HTTP, the driver's channel and the rank: a +100 bias makes greedy decoding repeat the biased token;
    a repetition penalty on top drops it after its first time; penalties change an answer that repeats itself."""
    def tokens(extra: dict | None = None, **kw):
        out = client.completions.create(model=model, prompt="def f(", max_tokens=40, temperature=0, logprobs=0,
                                        extra_body={**NO_EOS, **(extra or {})}, **kw)
        return out.choices[0].logprobs.tokens

    plain = tokens()
    biased = tokens(logit_bias={"77": 100})
    assert len(set(biased)) == 1 and biased != plain
    damped = tokens({"repetition_penalty": 1e4}, logit_bias={"77": 100})  # the extension
    assert damped[0] == biased[0] and biased[0] not in damped[1:]
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself
    assert tokens(frequency_penalty=2.0, presence_penalty=2.0) != plain


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, base_url, model, tiny_model):
    """``echo`` + ``logprobs`` + ``max_tokens`` 0 (how evaluation harnesses score text) through HTTP, the driver's
    channel and the rank: each prompt token's log-prob is transformers' log-softmax there, the first is null, and a
    second time (the prompt now cached) the scores are the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from raymoe.tokenizer import load_tokenizer

    prompt = "def add(a, b):\n    return a + b\n"
    ids = load_tokenizer(tiny_model).encode(prompt, add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    for _ in range(2):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                        temperature=0)
        lp = out.choices[0].logprobs
        assert out.choices[0].text == prompt and out.usage.completion_tokens == 0
        assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
        assert "".join(lp.tokens) == prompt and all(len(t) == 1 for t in lp.top_logprobs[1:])
    more = client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, temperature=0,
                                     extra_body=NO_EOS)
    assert more.choices[0].text.startswith(prompt) and more.usage.completion_tokens == 4
    batch = client.completions.create(model=model, prompt=["x = 1", prompt], max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[1].text == prompt
    assert batch.choices[1].logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    # lm-evaluation-harness's log-likelihood request: token-id prompts in a batch, max_tokens 1, echo, logprobs 1;
    # it reads token_logprobs[ctxlen:-1] and compares tokens with each top_logprobs' best
    harness = client.completions.create(model=model, prompt=[ids[:5], ids], max_tokens=1, echo=True, logprobs=1,
                                        temperature=0, seed=1234)
    lp = harness.choices[1].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[1:-1] == pytest.approx(want, abs=2e-4)
    greedy = [max(top, key=top.get) == tok for tok, top in zip(lp.tokens[1:-1], lp.top_logprobs[1:-1], strict=True)]
    best = logp[torch.arange(len(ids) - 1)].argmax(-1) == torch.tensor(ids[1:])
    assert greedy == best.tolist()
    # vLLM's prompt_logprobs extension, beside echo's own k: {token id: {logprob, rank, decoded_token}} per token
    ranks = ((logp[:-1] > torch.tensor(want)[:, None]).sum(1) + 1).tolist()
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        for path, body in (("/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
            r = h.post(f"{base_url}{path}", json={
                "model": model, "max_tokens": 1, "prompt_logprobs": 3, **body}).json()
            entries = r["choices"][0]["prompt_logprobs"] if "prompt" in body else r["prompt_logprobs"]
            assert entries[0] is None and all(3 <= len(e) <= 4 for e in entries[1:])
            if "prompt" in body:
                assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)] == pytest.approx(
                    want, abs=2e-4)
                assert [e[str(t)]["rank"] for e, t in zip(entries[1:], ids[1:], strict=True)] == ranks
                assert all(len(top) == 1 for top in r["choices"][0]["logprobs"]["top_logprobs"][1:])
        bad = h.post(f"{base_url}/v1/completions", json={"model": model, "prompt": prompt, "stream": True,
                                                               "prompt_logprobs": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


NUM_STREAMS = 64


def stream_body(model: str, i: int) -> dict:
    """Stream ``i`` of the concurrency test: its own prompt and seed, 8 to 15 tokens."""
    return {"model": model, "prompt": f"x{i} = [i for i in", "max_tokens": 8 + i % 8, "temperature": 0.7, "seed": i,
            "ignore_eos": True}


@pytest.fixture(scope="module")
def stream_refs(base_url, model) -> dict[int, str]:
    """The text of each concurrency-test stream run alone (not streamed, one request after another), before the
    load: seeded sampling is batch-invariant, so a stream under load must get exactly this text."""
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        refs = {i: h.post(f"{base_url}/v1/completions", json={**stream_body(model, i), "stream": False}).json()
                ["choices"][0]["text"] for i in range(NUM_STREAMS)}
    assert_distinct(refs)
    return refs


def run_streams(base_url: str, bodies: dict[int, dict]) -> dict[int, tuple[str, int]]:
    """Stream every body at once; per key (text received, chunks with a finish reason). Asserts each stream ends
    with ``[DONE]`` and carries no error event."""

    async def one(http: httpx.AsyncClient, body: dict) -> tuple[str, int]:
        async with http.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert not any("error" in e for e in events)
        return ("".join(e["choices"][0]["text"] for e in events),
                sum(1 for e in events if e["choices"][0]["finish_reason"]))

    async def run():
        limits = httpx.Limits(max_connections=len(bodies) + 6)
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=120, limits=limits) as h:
            outs = await asyncio.gather(*(one(h, body) for body in bodies.values()))
        return dict(zip(bodies, outs, strict=True))

    return asyncio.run(run())


def test_64_concurrent_streams_complete_and_release_everything(base_url, model, stream_refs):
    before = metrics(base_url)
    outs = run_streams(base_url, {i: stream_body(model, i) for i in range(NUM_STREAMS)})
    assert [finishes for _, finishes in outs.values()] == [1] * NUM_STREAMS
    assert_own_outputs({i: text for i, (text, _) in outs.items()}, stream_refs)
    wait_for(lambda: engine_idle(base_url), timeout_s=30)
    after = metrics(base_url)
    done = after["raymoe:request_success_total{finish_reason=length}"]
    assert done - before["raymoe:request_success_total{finish_reason=length}"] == NUM_STREAMS
    expected_tokens = sum(8 + i % 8 for i in range(NUM_STREAMS))
    assert after["raymoe:generation_tokens_total"] - before["raymoe:generation_tokens_total"] == expected_tokens
    assert after["raymoe:time_to_first_token_seconds_count"] - before["raymoe:time_to_first_token_seconds_count"] == (
        NUM_STREAMS)

    # Every engine step is in the step-time histograms, under exactly one mode, in both of them.
    def steps_by_mode(m: dict, name: str) -> dict[str, float]:
        return {mode: m[f"raymoe:{name}_count{{mode={mode}}}"] for mode in ("decode", "mixed", "extend")}

    steps = after["raymoe:engine_steps_total"] - before["raymoe:engine_steps_total"]
    for name in ("engine_step_period_seconds", "engine_step_forward_seconds"):
        grown = {k: v - steps_by_mode(before, name)[k] for k, v in steps_by_mode(after, name).items()}
        assert sum(grown.values()) == steps, (name, grown, steps)
        assert grown["decode"] > 0 and grown["mixed"] + grown["extend"] > 0, grown


def test_the_stream_check_catches_two_streams_that_swap_tokens(base_url, model, stream_refs, monkeypatch):
    """A test of the check above: a front end that hands two requests each other's tokens (the routing step
    patched, ``stream_check.SwapTwoStreams``) keeps every stream's length and finish reason, so counting passes;
    comparing each stream with its own reference fails, and passes again without the swap."""
    from raymoe.client import engine_client

    same_length = {i: stream_body(model, i) for i in range(0, NUM_STREAMS, 8)[:4]}  # 8 tokens each
    refs = {i: stream_refs[i] for i in same_length}

    def texts(outs):
        return {i: text for i, (text, _) in outs.items()}

    clean = run_streams(base_url, same_length)
    assert_own_outputs(texts(clean), refs)
    swap = SwapTwoStreams(engine_client._deliver)
    monkeypatch.setattr(engine_client, "_deliver", swap)
    swapped = run_streams(base_url, same_length)
    monkeypatch.undo()
    assert swap.swaps > 0, "the two streams never shared a step"
    assert [finishes for _, finishes in swapped.values()] == [1] * len(same_length)  # counting cannot tell
    with pytest.raises(AssertionError, match="2 of 4 streams got other tokens than their own"):
        assert_own_outputs(texts(swapped), refs)
    assert_own_outputs(texts(run_streams(base_url, same_length)), refs)
    wait_for(lambda: engine_idle(base_url), timeout_s=30)


def _raw_post(base_url: str, path: str, body: dict) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize(("stream", "n"), [(True, 1), (False, 1), (True, 2)])
def test_client_disconnect_aborts_the_request(base_url, model, stream, n):
    aborted = metrics(base_url)["raymoe:request_success_total{finish_reason=abort}"]
    body = {"model": model, "prompt": "def long(", "max_tokens": 140, "temperature": 0, "stream": stream,
            "ignore_eos": True, "n": n}
    sock = _raw_post(base_url, "/v1/completions", body)
    if stream:
        received = b""
        while b"data: " not in received:  # the stream started
            received += sock.recv(4096)
    wait_for(lambda: metrics(base_url)["raymoe:num_requests_running"] == n, timeout_s=30, interval_s=0.02)
    sock.close()
    wait_for(lambda: engine_idle(base_url), timeout_s=30, interval_s=0.05)
    assert metrics(base_url)["raymoe:request_success_total{finish_reason=abort}"] == aborted + n


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "M", "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/completions", {"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "x", "n": 129}, 400, "n"),
    ("/v1/completions", {"model": "M", "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "M", "prompt": "x", "top_k": 2**63}, 400, "top_k"),
    ("/v1/completions", {"model": "M", "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "M", "prompt": [5, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": "word " * 400}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "hi " * 400}]}, 400,
     "messages"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_openai_error_bodies(base_url, model, path, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": model}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{base_url}{path}", content=content, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"} and err["message"]
    assert err["request_id"] == r.headers["x-request-id"] and "Traceback" not in r.text
    assert err["param"] == param
    if "word" in content.decode():
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic dGVzdC1rZXk=", "Bearer", "test-key"])
def test_missing_or_wrong_api_key_is_401(base_url, model, auth):
    headers = {"Authorization": auth} if auth else {}
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        r = httpx.request(method, f"{base_url}{path}", json={"model": model, "prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_raises_typed_errors(base_url, client, model):
    import openai

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"


def test_dashboard_queries_only_exported_metrics(base_url):
    from server_harness import dashboard_metrics, exported_names

    samples, declared = exported_names(httpx.get(f"{base_url}/metrics").text)
    queried = dashboard_metrics()
    assert len(queried) >= 12
    assert queried <= declared, queried - declared
    # Every series has samples after the requests of the tests above (step times included), but the expert-load
    # ones: this engine records no expert load (tests/test_expert_load_serve.py scrapes them from one that does).
    expert_series = {"raymoe:expert_load", "raymoe:expert_balance", "raymoe:eplb_moving"}
    assert queried - expert_series <= samples, queried - expert_series - samples
