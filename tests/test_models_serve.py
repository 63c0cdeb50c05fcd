"""The OpenAI-compatible server and the ``raymoe generate`` command on tiny DeepSeek-V3 and Mixtral folders
(``make-checkpoint`` builds them with a tokenizer and a chat template)."""

from __future__ import annotations

import pytest
from openai import OpenAI
from server_harness import uvicorn_server

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}


@pytest.fixture(scope="module", params=["deepseek_v3", "mixtral"])
def folder(request, tmp_path_factory) -> str:
    return str(make_checkpoint(request.param, tmp_path_factory.mktemp("serve") / request.param, seed=1, **DIMS))


def test_chat_and_completions_over_http(ray_cluster, folder):
    from raymoe.client.engine_client import EngineClient
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.engine import _split_options

    with Engine(folder, max_running_requests=4, max_context_len=128) as e:
        expected = e.generate(["def fib(n):"], SamplingParams(max_tokens=10, temperature=0.0))[0]
    engine = EngineClient(_split_options(folder, {"max_running_requests": 4, "max_context_len": 128}))
    try:
        with uvicorn_server(build_openai_app(engine)) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            model = client.models.list().data[0].id
            comp = client.completions.create(model=model, prompt="def fib(n):", max_tokens=10, temperature=0)
            assert comp.choices[0].text == expected.text and comp.usage.completion_tokens == len(expected.token_ids)
            chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=8, temperature=0)
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8, temperature=0, stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert streamed == chat.choices[0].message.content and chat.usage.completion_tokens > 0
    finally:
        engine.shutdown()


def test_generate_command(folder, capsys):
    from raymoe.cli import main

    assert main(["generate", "--model", folder, "--prompt", "import os", "--max-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("import os") and len(captured.out.strip()) > len("import os")
    assert "tokens, finish_reason=" in captured.err
