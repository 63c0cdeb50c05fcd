"""gpt-oss chats in harmony (``raymoe.deploy.harmony``) on the real o200k vocabulary (``harmony_vocab``: skipped where
it cannot be had): prompts rendered by openai-harmony from OpenAI messages, tools and ``reasoning_effort``; answers
parsed from token ids into ``reasoning_content``, ``content`` and ``tool_calls``, streamed and not, through the
OpenAI app and the ``openai`` client (a scripted engine answers harmony tokens); a tiny gpt-oss checkpoint with
gpt-oss's tokenizer in the engine; the 400s of what harmony chats do not take."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from harmony_vocab import HARMONY_VOCAB_SIZE, harmony_tokenizer_dir, o200k_dir
from openai import OpenAI
from server_harness import uvicorn_server

from raymoe.deploy.protocol import ChatCompletionRequest

oh = pytest.importorskip("openai_harmony")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tokenizer_dir():
    vocab = o200k_dir()
    if vocab is None:
        pytest.skip("the o200k_base vocabulary is neither cached, in TIKTOKEN_ENCODINGS_BASE nor reachable on npm")
    os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(vocab))  # openai-harmony reads it there
    return harmony_tokenizer_dir(vocab)


@pytest.fixture(scope="module")
def chat(tokenizer_dir):
    from transformers import AutoTokenizer

    from raymoe.deploy.harmony import HarmonyChat

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    found = HarmonyChat.for_tokenizer(tok)
    assert found is not None
    return SimpleNamespace(harmony=found, tokenizer=tok, enc=found.encoding)


def _answer(enc, *messages) -> list[int]:
    """An assistant answer as the model writes it: the rendered messages without the prompt's ``<|start|>assistant``."""
    ids = [t for m in messages for t in enc.render(m)]
    return ids[2:]


def _analysis_then_call(enc) -> list[int]:
    return _answer(enc, oh.Message.from_role_and_content(oh.Role.ASSISTANT, "The user wants Paris weather.")
                   .with_channel("analysis"),
                   oh.Message.from_role_and_content(oh.Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
                   .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"))


def test_the_prompt_is_harmonys_rendering_of_the_messages(chat):
    req = ChatCompletionRequest.model_validate({
        "model": "m", "tools": TOOLS, "reasoning_effort": "high", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 20}"},
            {"role": "assistant", "content": "It is 20 degrees."},
            {"role": "user", "content": "Thanks"}]})
    text = chat.enc.decode(chat.harmony.render(req))
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "namespace functions {" in text and "type get_weather = (_: {" in text
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
            "{\"city\": \"Paris\"}<|call|>") in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"temp\": 20}<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>It is 20 degrees.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Thanks<|end|><|start|>assistant")
    assert chat.enc.decode(chat.harmony.render(req, constrained=True)).endswith(
        "<|start|>assistant<|channel|>final<|message|>")
    # the model's tokenizer reads the prompt as the same ids
    assert chat.tokenizer.encode(text, add_special_tokens=False) == chat.harmony.render(req)
    orphan = req.model_copy(update={"messages": req.messages[:1] + req.messages[3:4]})
    with pytest.raises(ValueError, match="no earlier assistant message"):
        chat.harmony.render(orphan)


def test_answers_split_into_reasoning_content_and_calls_token_by_token_or_whole(chat):
    enc = chat.enc
    answer = _answer(enc, oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Think first.").with_channel("analysis"),
                     oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Hello there!").with_channel("final"))
    for chunks in ([answer], [[t] for t in answer]):
        stream = chat.harmony.stream(None)
        parts = [stream.feed(c) for c in chunks]
        rest, calls = stream.finish()
        assert "".join(p.reasoning for p in parts) + rest.reasoning == "Think first."
        assert "".join(p.content for p in parts) + rest.content == "Hello there!" and calls == ()
    stream = chat.harmony.stream(frozenset({"get_weather"}))
    split = stream.feed(_analysis_then_call(enc))
    rest, calls = stream.finish()
    assert split.reasoning == "The user wants Paris weather." and split.content + rest.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    stream = chat.harmony.stream(frozenset({"other_tool"}))  # a call to a tool the request does not have is text
    stream.feed(_analysis_then_call(enc))
    rest, calls = stream.finish()
    assert calls == () and rest.content == '{"city": "Paris"}'
    stream = chat.harmony.stream(None)  # not harmony at all: the text as written, at the end
    assert stream.feed(enc.encode("just words")).content == ""
    assert stream.finish()[0].content == "just words"


@pytest.fixture(scope="module")
def scripted_server(chat):
    """The OpenAI app over an engine that answers a fixed harmony answer (analysis, then a tool call)."""
    from raymoe.deploy.openai_api import build_openai_app

    engine = FakeEngine(chat.tokenizer)
    engine.model_config.model_type = "gpt_oss"
    engine.token_cycle = _analysis_then_call(chat.enc)
    with uvicorn_server(build_openai_app(engine)) as url:
        yield SimpleNamespace(url=url, engine=engine, answer_len=len(engine.token_cycle))


def test_the_openai_client_gets_reasoning_and_tool_calls_streamed_and_not(scripted_server, chat):
    client = OpenAI(base_url=f"{scripted_server.url}/v1", api_key="x")
    kw = dict(model="fake", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              max_tokens=scripted_server.answer_len, reasoning_effort="low")
    whole = client.chat.completions.create(**kw).choices[0]
    msg = whole.message
    assert whole.finish_reason == "tool_calls" and msg.content is None
    assert msg.reasoning_content == "The user wants Paris weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    prompt, params = scripted_server.engine.seen[-1]
    assert chat.enc.decode(prompt).endswith("<|start|>assistant") and "Reasoning: low" in chat.enc.decode(prompt)
    assert set(chat.harmony.stop_token_ids) <= set(params.stop_token_ids)
    reasoning, calls, finish = [], [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == msg.reasoning_content and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls]


def test_what_harmony_chats_do_not_take_is_a_400_naming_the_field(scripted_server):
    import httpx

    base = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, field in (({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
                         ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
                         ({"reasoning_effort": "extreme"}, "reasoning_effort")):
        r = httpx.post(f"{scripted_server.url}/v1/chat/completions", json={**base, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (extra, r.text)


def test_a_tiny_gpt_oss_with_gpt_oss_tokenizer_answers_a_harmony_prompt(tmp_path, tokenizer_dir, chat):
    """``make_checkpoint(tokenizer=...)``: a tiny gpt-oss speaking harmony's vocabulary runs in the engine on the
    rendered prompt, and whatever its random weights write is parsed without an error."""
    from raymoe import Engine, SamplingParams
    from raymoe.models.checkpoint import make_checkpoint

    path = make_checkpoint("gpt_oss", tmp_path / "gpt_oss", seed=1, num_layers=2, hidden_size=32, num_heads=4,
                           num_kv_heads=2, head_dim=8, num_experts=4, moe_intermediate_size=16,
                           vocab_size=HARMONY_VOCAB_SIZE, tokenizer=tokenizer_dir)
    req = ChatCompletionRequest.model_validate({"model": "m", "tools": TOOLS,
                                                "messages": [{"role": "user", "content": "Weather in Paris?"}]})
    prompt = chat.harmony.render(req)
    with Engine(str(path), max_context_len=512) as e:
        assert set(chat.harmony.stop_token_ids) <= set(e.model_config.eos_token_ids)
        out = e.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert len(out.token_ids) >= 1 and max(out.token_ids) < HARMONY_VOCAB_SIZE
    stream = chat.harmony.stream(frozenset({"get_weather"}))
    stream.feed(out.token_ids)
    stream.finish()


def test_a_tokenizer_bigger_than_the_vocabulary_is_refused(tmp_path, tokenizer_dir):
    from raymoe.errors import InvalidRequestError
    from raymoe.models.checkpoint import make_checkpoint

    with pytest.raises(InvalidRequestError) as err:
        make_checkpoint("gpt_oss", tmp_path / "small", vocab_size=512, tokenizer=tokenizer_dir)
    assert err.value.field == "tokenizer" and "201088 ids" in err.value.message


def test_a_gpt_oss_tokenizer_without_harmonys_tokens_keeps_the_chat_template(tiny_model, monkeypatch):
    """The seeded tiny checkpoints' tokenizer has no harmony tokens: no harmony, and no vocabulary download."""
    from raymoe.deploy import harmony
    from raymoe.tokenizer import load_tokenizer

    def loaded():
        raise AssertionError("the vocabulary was loaded")

    monkeypatch.setattr(harmony, "harmony_encoding", loaded)
    assert harmony.HarmonyChat.for_tokenizer(load_tokenizer(tiny_model)) is None


def test_output_that_stops_being_harmony_keeps_its_text(chat):
    enc = chat.enc
    answer = _answer(enc, oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Think.").with_channel("analysis"))
    broken = answer + enc.encode("<|message|>", allowed_special="all") + enc.encode(" tail text")
    stream = chat.harmony.stream(None)
    split = stream.feed(broken)
    rest, calls = stream.finish()
    assert split.reasoning == "Think." and rest.content.endswith(" tail text") and calls == ()
