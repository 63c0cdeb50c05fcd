"""Reasoning content through the OpenAI app (``--reasoning-parser qwen3``) with a checkpoint whose chat template
opens the thinking in the prompt (``<think>`` after the assistant header, Qwen3's ``enable_thinking``; an empty
thinking block when it is false) and renders ``tools``: the split of the answer, streamed and not,
``chat_template_kwargs``, and tools reaching the template of a real engine through the ``openai`` client.

The tiny model writes noise that never closes the thinking, so with thinking on its whole answer is reasoning
(``content`` empty) and with ``enable_thinking: false`` its whole answer is content; the split at a ``</think>``
inside the text is covered piece by piece in ``test_reasoning.py``.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from openai import OpenAI
from server_harness import uvicorn_server

THINKING_TEMPLATE = (
    "{%- if tools %}{{- '<tools>' + (tools | tojson) + '</tools>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def thinking_model(tiny_model, tmp_path_factory) -> str:
    """The tiny checkpoint with the thinking chat template."""
    out = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def base_url(ray_cluster, thinking_model):
    from raymoe.client.engine_client import EngineClient
    from raymoe.config import engine_config_from_options
    from raymoe.deploy.openai_api import build_openai_app

    engine = EngineClient(engine_config_from_options(thinking_model, {"max_context_len": 160}), model_name="think")
    try:
        with uvicorn_server(build_openai_app(engine, reasoning_parser="qwen3")) as url:
            yield url
    finally:
        engine.shutdown()


def _ask(client: OpenAI, stream: bool, **extra):
    kw = dict(model="think", messages=[{"role": "user", "content": "def fib(n):"}], max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True, **extra})
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        return getattr(m, "reasoning_content", None), m.content
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            content.append(c.delta.content or "")
    return "".join(reasoning) or None, "".join(content)


def test_thinking_goes_to_reasoning_content_streamed_or_not(base_url):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    whole = _ask(client, stream=False)
    assert whole[0] and whole[1] == ""  # the thinking never closed: all reasoning
    assert _ask(client, stream=True) == whole
    off = _ask(client, stream=False, chat_template_kwargs={"enable_thinking": False})
    assert off[0] is None and off[1]  # an empty thinking block in the prompt: all answer
    assert _ask(client, stream=True, chat_template_kwargs={"enable_thinking": False}) == off


def test_tools_reach_the_template_and_a_plain_answer_stays_content(base_url):
    """The tiny model writes no call: the answer is content (here: reasoning, thinking on), finish_reason length;
    the tools made the prompt longer by their rendering."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    kw = dict(model="think", messages=[{"role": "user", "content": "weather?"}], max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    with_tools = client.chat.completions.create(**kw, tools=tools, tool_choice="auto")
    assert with_tools.choices[0].finish_reason == "length" and not with_tools.choices[0].message.tool_calls
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 10


def test_chat_template_kwargs_may_not_set_the_servers_own_arguments(base_url):
    r = httpx.post(f"{base_url}/v1/chat/completions", json={
        "model": "think", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"tokenize": False}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    r = httpx.post(f"{base_url}/v1/chat/completions", json={
        "model": "think", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": {"nested": 1}}}, timeout=30)
    assert r.status_code == 400, r.text
