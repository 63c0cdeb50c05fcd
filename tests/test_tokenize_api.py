"""``POST /tokenize`` and ``POST /detokenize`` (``raymoe.deploy.tokenize_api``): the ids a prompt or a conversation
become are those the completion routes send the engine; ids read back as the tokenizer's text; errors name their
field; the API key guards them as it guards ``/v1/*``."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest
from fake_engine import FakeEngine

KEY = "k"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from raymoe.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture
def served(tokenizer):
    from raymoe.deploy.openai_api import build_openai_app

    engine = FakeEngine(tokenizer)
    app = build_openai_app(engine, api_key=KEY)

    def post(path: str, body: dict, key: str | None = KEY) -> httpx.Response:
        async def main():
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                return await c.post(path, content=json.dumps({"model": "fake", **body}), headers=headers)

        return anyio.run(main)

    return engine, post


def test_tokenize_counts_what_the_completion_routes_send(served, tokenizer):
    engine, post = served
    text = "def add(a, b):\n    return a + b"
    r = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert post("/v1/completions", {"prompt": text, "max_tokens": 1}).status_code == 200
    assert r["tokens"] == engine.seen[-1][0] and r["count"] == len(r["tokens"]) > 0
    assert r["max_model_len"] == engine.max_context_len
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    chat = post("/tokenize", {"messages": MESSAGES}).json()
    assert post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    assert chat["tokens"] == engine.seen[-1][0] and chat["token_strs"] is None
    assert chat["count"] > len(tokenizer.encode("be brief hello there", add_special_tokens=False))


def test_detokenize_reads_ids_back(served, tokenizer):
    _, post = served
    ids = tokenizer.encode("x = [i for i in range(3)]", add_special_tokens=False)
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": "x = [i for i in range(3)]"}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "nobody", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_bad_bodies_name_their_field(served, path, body, status, param):
    _, post = served
    r = post(path, body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_the_api_key_guards_them(served):
    _, post = served
    assert post("/tokenize", {"prompt": "a"}, key=None).status_code == 401
    assert post("/detokenize", {"tokens": [1]}, key="wrong").status_code == 401
