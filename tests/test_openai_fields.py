"""Every request field of the OpenAI API is honoured or refused, never silently ignored (``openai_fields``).

The classification test walks the request fields of the ``openai`` package's own parameter types (completions, chat
completions, each chat message type): a field a future ``openai`` release adds fails it until it is classified.
Each honoured field names a behaviour test here (in :data:`BEHAVIOUR`) that shows the server using it; each neutral
or refused field is sent with a value the engine cannot honour and must get a 400 naming it, while its neutral
values are accepted. A fake engine (tests/fake_engine.py) records what reaches the engine.
"""

from __future__ import annotations

import json
import typing

import anyio
import httpx
import pytest
from fake_engine import FakeEngine
from openai.types import completion_create_params
from openai.types.chat import chat_completion_message_param
from openai.types.chat import completion_create_params as chat_create_params

from raymoe.deploy.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, MESSAGE_FIELDS

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}


def _typed_dict_keys(union) -> set[str]:
    """Every key of the TypedDicts of ``union`` (a parameter type of the ``openai`` package)."""
    return {key for t in typing.get_args(union) for key in t.__required_keys__ | t.__optional_keys__}


OPENAI_FIELDS = {
    "completion": (_typed_dict_keys(completion_create_params.CompletionCreateParams), COMPLETION_FIELDS),
    "chat": (_typed_dict_keys(chat_create_params.CompletionCreateParams), CHAT_FIELDS),
    "message": (_typed_dict_keys(chat_completion_message_param.ChatCompletionMessageParam), MESSAGE_FIELDS),
}

# Honoured field -> the test below that shows the server using it.
BEHAVIOUR = {
    "model": "test_model_must_name_the_served_model",
    "prompt": "test_prompt_forms_reach_the_engine",
    "messages": "test_messages_reach_the_chat_template",
    "role": "test_messages_reach_the_chat_template",
    "content": "test_messages_reach_the_chat_template",
    "name": "test_messages_reach_the_chat_template",
    "temperature": "test_sampling_fields_reach_the_engine",
    "top_p": "test_sampling_fields_reach_the_engine",
    "seed": "test_sampling_fields_reach_the_engine",
    "stop": "test_sampling_fields_reach_the_engine",
    "presence_penalty": "test_penalty_fields_reach_the_engine_and_bad_ones_are_400s",
    "frequency_penalty": "test_penalty_fields_reach_the_engine_and_bad_ones_are_400s",
    "logit_bias": "test_penalty_fields_reach_the_engine_and_bad_ones_are_400s",
    "n": "test_n_answers_each_choice_with_its_own_generation",
    "max_tokens": "test_output_length_fields_reach_the_engine",
    "max_completion_tokens": "test_output_length_fields_reach_the_engine",
    "logprobs": "test_logprob_fields_shape_the_answer",
    "echo": "test_echo_opens_the_answer_with_the_prompt_and_scores_it",
    "top_logprobs": "test_logprob_fields_shape_the_answer",
    "stream": "test_stream_fields_shape_the_answer",
    "stream_options": "test_stream_fields_shape_the_answer",
    "user": "test_identity_fields_change_nothing",
    "safety_identifier": "test_identity_fields_change_nothing",
    "prompt_cache_key": "test_identity_fields_change_nothing",
    "tools": "test_tool_fields_reach_the_template_and_shape_the_answer",
    "tool_choice": "test_tool_fields_reach_the_template_and_shape_the_answer",
    "parallel_tool_calls": "test_tool_fields_reach_the_template_and_shape_the_answer",
    "tool_calls": "test_tool_fields_reach_the_template_and_shape_the_answer",
    "tool_call_id": "test_tool_fields_reach_the_template_and_shape_the_answer",
    "response_format": "test_output_constraints_reach_the_engine_and_bad_ones_are_400s",
    "reasoning_effort": "test_reasoning_effort_is_taken_by_harmony_models_only",
}


class _RecordingTokenizer:
    """The real tokenizer, recording the messages each chat template call gets."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.templated: list[list[dict]] = []
        self.template_tools: list[list[dict] | None] = []

    def apply_chat_template(self, messages, **kwargs):
        self.templated.append(messages)
        self.template_tools.append(kwargs.get("tools"))
        return self._tok.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    @property
    def __class__(self):  # isinstance() sees the real tokenizer's class (xgrammar's TokenizerInfo checks it)
        return type(self._tok)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from raymoe.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture
def served(tokenizer):
    """(engine, post): a fresh fake engine behind the app, and ``post(path, fields)`` -> response."""
    from raymoe.deploy.openai_api import build_openai_app

    engine = FakeEngine(_RecordingTokenizer(tokenizer))
    app = build_openai_app(engine)

    def post(path: str, fields: dict) -> httpx.Response:
        async def main():
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
                return await c.post(path, content=json.dumps({"model": "fake", **fields}))

        return anyio.run(main)

    return engine, post


def _body(path: str, **fields) -> dict:
    base = {"prompt": "hi"} if path == COMPLETIONS else {"messages": [USER]}
    return {**base, "max_tokens": 2, **fields}


@pytest.mark.parametrize("kind", OPENAI_FIELDS)
def test_every_openai_request_field_is_classified(kind):
    fields, table = OPENAI_FIELDS[kind]
    unclassified = sorted(fields - set(table))
    assert not unclassified, f"classify these {kind} fields in raymoe/deploy/openai_fields.py: {unclassified}"
    stale = sorted(set(table) - fields)
    assert not stale, f"these {kind} fields are no longer in the openai package: {stale}"


def test_every_honoured_field_has_a_behaviour_test():
    honoured = {name for _, table in OPENAI_FIELDS.values() for name, rule in table.items()
                if rule.status == "honoured"}
    assert honoured == set(BEHAVIOUR)
    assert all(callable(globals().get(test)) for test in BEHAVIOUR.values())


def test_reasoning_effort_is_taken_by_harmony_models_only(served):
    """A harmony model (gpt-oss) states it in its system message (``test_harmony``); any other model refuses it."""
    engine, post = served
    r = post(CHAT, _body(CHAT, reasoning_effort="low"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text
    assert not engine.seen


NOT_HONOURED = [(path, name) for path, table in ((COMPLETIONS, COMPLETION_FIELDS), (CHAT, CHAT_FIELDS))
                for name, rule in table.items() if rule.status != "honoured"]


@pytest.mark.parametrize(("path", "name"), NOT_HONOURED)
def test_unsupported_fields_are_refused_naming_them(served, path, name):
    engine, post = served
    rule = (COMPLETION_FIELDS if path == COMPLETIONS else CHAT_FIELDS)[name]
    r = post(path, _body(path, **{name: {"asks_for": "something"}}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_value" and err["message"].startswith(f"{name}: ")
    assert not engine.seen
    for value in (None, *rule.neutral):
        r = post(path, _body(path, **{name: value}))
        assert r.status_code == 200, (name, value, r.text)


@pytest.mark.parametrize("name", [n for n, rule in MESSAGE_FIELDS.items() if rule.status != "honoured"])
def test_unsupported_message_fields_are_refused_naming_them(served, name):
    engine, post = served
    message = {"role": "assistant", "content": "x", name: [{"id": "call_1", "type": "function"}]}
    r = post(CHAT, _body(CHAT, messages=[USER, message, USER]))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["message"].startswith(f"messages[1].{name}: ")
    assert not engine.seen
    for value in (None, *MESSAGE_FIELDS[name].neutral):
        assert post(CHAT, _body(CHAT, messages=[USER, {**message, name: value}, USER])).status_code == 200


def test_model_must_name_the_served_model(served):
    _, post = served
    r = post(COMPLETIONS, {**_body(COMPLETIONS), "model": "another"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert post(COMPLETIONS, _body(COMPLETIONS)).status_code == 200


def test_prompt_forms_reach_the_engine(served, tokenizer):
    engine, post = served
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    for prompt in ("hello there", ids, ["hello there"], [ids]):
        assert post(COMPLETIONS, _body(COMPLETIONS, prompt=prompt)).status_code == 200
        assert engine.seen[-1][0] == ids


def test_a_batch_of_prompts_answers_each_with_its_choices(served, tokenizer):
    """A list of prompts: each prompt's ``n`` choices are engine requests of their own, choice ``p * n + j`` for
    prompt ``p``; the usage counts each prompt once; a bad prompt is a 400 naming which; the batch takes its
    in-flight places."""
    engine, post = served
    texts = ["hello there", "def f(x):", "a b c d"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for prompt in (texts, ids):
        engine.seen.clear()
        body = post(COMPLETIONS, _body(COMPLETIONS, prompt=prompt, n=2, seed=3, max_tokens=3, echo=True)).json()
        assert [c["index"] for c in body["choices"]] == list(range(6))
        assert [p for p, _ in engine.seen] == [ids[0], ids[0], ids[1], ids[1], ids[2], ids[2]]
        assert [c["text"][:len(texts[i // 2])] for i, c in enumerate(body["choices"])] == [
            tokenizer.decode(ids[i // 2]) for i in range(6)]
        assert [p.seed for _, p in engine.seen][::2] == [3, 3, 3]  # choice 0 of each prompt keeps the seed
        assert body["usage"]["prompt_tokens"] == sum(map(len, ids)) and body["usage"]["completion_tokens"] == 18
    r = post(COMPLETIONS, _body(COMPLETIONS, prompt=texts, max_tokens=2, stream=True,
                                stream_options={"include_usage": True}))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert sorted(c["index"] for ch in chunks[:-1] for c in ch["choices"] if c["finish_reason"]) == [0, 1, 2]
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(map(len, ids))
    bad = post(COMPLETIONS, _body(COMPLETIONS, prompt=["ok", "x " * 5000], max_tokens=1)).json()["error"]
    assert bad["param"] == "prompt" and bad["message"].startswith("prompt[1]: ")
    r = post(COMPLETIONS, _body(COMPLETIONS, prompt=["a"] * 9))  # 9 engine requests: more than the 8 places
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert not engine.open


def test_messages_reach_the_chat_template(served):
    engine, post = served
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                 "name": "ann"}, {"role": "assistant", "content": None}, {"role": "tool", "content": "r"}]
    assert post(CHAT, _body(CHAT, messages=messages)).status_code == 200
    assert tok.templated[-1] == [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"},
                                 {"role": "user", "content": "ab", "name": "ann"},
                                 {"role": "assistant", "content": ""}, {"role": "tool", "content": "r"}]
    assert engine.seen[-1][0] == tok.apply_chat_template(tok.templated[-1], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CALLS_TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _stream_answer(r: httpx.Response) -> tuple[str, list[dict], str | None]:
    """(content, tool calls, finish reason) of a streamed chat answer, its deltas joined."""
    content, calls, finish = "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                calls.setdefault(call["index"], {"name": "", "arguments": ""})
                calls[call["index"]]["name"] += call["function"].get("name") or ""
                calls[call["index"]]["arguments"] += call["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_fields_reach_the_template_and_shape_the_answer(served):
    """The tools reach the chat template with the history's calls and results; the model's calls (the fake engine
    writes two in Qwen3's format) come back as ``tool_calls`` with ``finish_reason`` tool_calls, streamed deltas
    joining to the same calls; ``parallel_tool_calls`` false keeps the first; ``tool_choice`` none leaves the text
    alone; required, named, a choice without tools, two tools of one name, a tool without a name or with a name
    OpenAI does not allow are 400s naming the field."""
    engine, post = served
    tok = engine.tokenizer
    engine.token_cycle = tok.encode(CALLS_TEXT, add_special_tokens=False)
    n = len(engine.token_cycle)
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}, USER]
    r = post(CHAT, {"messages": history, "tools": TOOLS, "max_tokens": n})
    assert r.status_code == 200, r.text
    assert tok.templated[-1][1]["tool_calls"][0]["function"]["name"] == "get_time"
    assert tok.templated[-1][2]["tool_call_id"] == "call_1" and tok.template_tools[-1] == TOOLS
    choice = r.json()["choices"][0]
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in choice["message"]["tool_calls"]]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in choice["message"]["tool_calls"])
    streamed = post(CHAT, {"messages": [USER], "tools": TOOLS, "max_tokens": n, "stream": True})
    assert _stream_answer(streamed) == ("Let me check.", calls, "tool_calls")
    one = post(CHAT, {"messages": [USER], "tools": TOOLS, "max_tokens": n, "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in one.json()["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    none = post(CHAT, {"messages": [USER], "tools": TOOLS, "max_tokens": n, "tool_choice": "none"})
    assert none.json()["choices"][0]["message"] == {"role": "assistant", "content": CALLS_TEXT}
    assert tok.template_tools[-1] is None
    required = post(CHAT, {"messages": [USER], "tools": TOOLS, "max_tokens": n, "tool_choice": "required"})
    assert required.status_code == 200 and engine.seen[-1][1].grammar.field == "tool_choice"
    assert "get_weather" in engine.seen[-1][1].grammar.source and "get_time" in engine.seen[-1][1].grammar.source
    named = post(CHAT, {"messages": [USER], "tools": TOOLS, "max_tokens": n,
                        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.status_code == 200 and "get_weather" not in engine.seen[-1][1].grammar.source
    for fields, param in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice"),
                          ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice"),
                          ({"tool_choice": "auto"}, "tool_choice"),
                          ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
                          ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
                          ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools")):
        r = post(CHAT, _body(CHAT, **fields))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)


def test_sampling_fields_reach_the_engine(served):
    engine, post = served
    for path in (COMPLETIONS, CHAT):
        r = post(path, _body(path, temperature=0.3, top_p=0.7, seed=11, stop=["zz", "yy"]))
        assert r.status_code == 200, r.text
        params = engine.seen[-1][1]
        assert (params.temperature, params.top_p, params.seed, params.stop) == (0.3, 0.7, 11, ("zz", "yy"))
        assert post(path, _body(path, min_tokens=2)).status_code == 200 and engine.seen[-1][1].min_tokens == 2
        bad = post(path, _body(path, min_tokens=3)).json()["error"]  # more than max_tokens (2)
        assert bad["param"] == "min_tokens"
        bad = post(path, _body(path, min_tokens=1, regex="a+")).json()["error"]
        assert bad["param"] == "min_tokens"


def test_penalty_fields_reach_the_engine_and_bad_ones_are_400s(served, tokenizer):
    """What the penalties do to the tokens: tests/test_penalties.py (against transformers)."""
    engine, post = served
    for path in (COMPLETIONS, CHAT):
        r = post(path, _body(path, presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.2,
                             logit_bias={"7": -100, "3": 2.5}))
        assert r.status_code == 200, r.text
        p = engine.seen[-1][1]
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.5, 1.2)
        assert p.logit_bias == ((3, 2.5), (7, -100.0)) and p.processes_logits
    seen = len(engine.seen)
    bad = [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {"x": 1}),
           ("logit_bias", {"7": 101}), ("logit_bias", {str(len(tokenizer)): 1}), ("logit_bias", {"-1": 1}),
           ("logit_bias", {"7": "a"})]
    for field, value in bad:
        r = post(COMPLETIONS, _body(COMPLETIONS, **{field: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, value, r.text)
    assert len(engine.seen) == seen


def test_n_answers_each_choice_with_its_own_generation(served):
    """``n`` choices: one engine request each (a seeded request derives a seed per choice, choice 0 keeps it), the
    choices by index, one usage (prompt once, completions summed); streamed, every choice's chunks carry its index
    and finish, then the usage and [DONE]; every engine request is closed."""
    engine, post = served
    for path in (COMPLETIONS, CHAT):
        engine.seen.clear()
        r = post(path, _body(path, n=3, seed=5, max_tokens=4, logprobs=path == CHAT or 1))
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["finish_reason"] == "length" for c in body["choices"])
        seeds = [params.seed for _, params in engine.seen]
        assert len(seeds) == 3 and seeds[0] == 5 and len(set(seeds)) == 3
        prompt = len(engine.seen[0][0])
        assert body["usage"]["prompt_tokens"] == prompt and body["usage"]["completion_tokens"] == 12
        assert body["usage"]["total_tokens"] == prompt + 12
        r = post(path, _body(path, n=2, max_tokens=3, stream=True, stream_options={"include_usage": True}))
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage = chunks[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
        finished = [c["index"] for ch in chunks[:-1] for c in ch["choices"] if c["finish_reason"]]
        assert sorted(finished) == [0, 1]
        assert {c["index"] for ch in chunks[:-1] for c in ch["choices"]} == {0, 1}
        assert len({ch["id"] for ch in chunks}) == 1
    assert not engine.open
    assert post(COMPLETIONS, _body(COMPLETIONS, n=129)).json()["error"]["param"] == "n"
    # each choice takes one of the server's in-flight places (here 4 running + 4 queued)
    assert post(COMPLETIONS, _body(COMPLETIONS, n=8)).status_code == 200
    r = post(COMPLETIONS, _body(COMPLETIONS, n=9))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_output_length_fields_reach_the_engine(served):
    engine, post = served
    post(COMPLETIONS, _body(COMPLETIONS, max_tokens=5))
    assert engine.seen[-1][1].max_tokens == 5
    post(CHAT, {"messages": [USER], "max_completion_tokens": 6, "max_tokens": 9})  # the new name wins
    assert engine.seen[-1][1].max_tokens == 6
    r = post(CHAT, {"messages": [USER], "max_tokens": 3})
    assert engine.seen[-1][1].max_tokens == 3 and r.json()["usage"]["completion_tokens"] == 3


def test_logprob_fields_shape_the_answer(served):
    _, post = served
    r = post(COMPLETIONS, _body(COMPLETIONS, logprobs=3)).json()
    assert all(len(top) == 3 for top in r["choices"][0]["logprobs"]["top_logprobs"])
    r = post(CHAT, _body(CHAT, logprobs=True, top_logprobs=2)).json()
    assert all(len(t["top_logprobs"]) == 2 for t in r["choices"][0]["logprobs"]["content"])
    assert post(CHAT, _body(CHAT)).json()["choices"][0]["logprobs"] is None


def test_echo_opens_the_answer_with_the_prompt_and_scores_it(served, tokenizer):
    """``echo`` puts the prompt before the completion; with ``logprobs`` the engine scores the prompt and the
    answer's log-prob lists run over prompt and completion (the first prompt token: null); ``max_tokens`` 0 scores
    only, and needs ``echo``; streams open with the prompt."""
    engine, post = served
    prompt = "def add(a, b):"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    r = post(COMPLETIONS, _body(COMPLETIONS, prompt=prompt, echo=True)).json()
    assert r["choices"][0]["text"].startswith(prompt) and len(r["choices"][0]["text"]) > len(prompt)
    assert engine.seen[-1][1].prompt_logprobs is None and r["choices"][0]["logprobs"] is None
    r = post(COMPLETIONS, _body(COMPLETIONS, prompt=prompt, echo=True, logprobs=2)).json()
    lp = r["choices"][0]["logprobs"]
    assert engine.seen[-1][1].prompt_logprobs == 2
    assert len(lp["tokens"]) == len(ids) + 2 and "".join(lp["tokens"][:len(ids)]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == [-(j + 1.0) for j in range(len(ids) - 1)]  # the fake's scores
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][len(ids)] == len(prompt) and r["usage"]["completion_tokens"] == 2
    r = post(COMPLETIONS, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()  # score only
    choice = r["choices"][0]
    assert engine.seen[-1][1].max_tokens == 1 and choice["text"] == tokenizer.decode(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids)
    bad = post(COMPLETIONS, {"prompt": prompt, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    r = post(COMPLETIONS, _body(COMPLETIONS, prompt=prompt, echo=True, logprobs=1, stream=True))
    first = json.loads(r.text.splitlines()[0].removeprefix("data: "))["choices"][0]
    assert first["text"].startswith(prompt) and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(ids) + 1


def test_stream_fields_shape_the_answer(served):
    _, post = served
    for path in (COMPLETIONS, CHAT):
        r = post(path, _body(path, stream=True, stream_options={"include_usage": True}))
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


def test_identity_fields_change_nothing(served):
    engine, post = served
    post(CHAT, _body(CHAT, seed=1))
    plain = engine.seen[-1]
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        assert post(CHAT, _body(CHAT, seed=1, **{name: "id-7"})).status_code == 200
        assert engine.seen[-1] == plain
    post(COMPLETIONS, _body(COMPLETIONS, seed=1))
    plain = engine.seen[-1]
    assert post(COMPLETIONS, _body(COMPLETIONS, seed=1, user="id-7")).status_code == 200
    assert engine.seen[-1] == plain


def test_output_constraints_reach_the_engine_and_bad_ones_are_400s(served):
    """``response_format`` json_object / json_schema (with ``strict``) and the ``regex`` / ``ebnf`` extensions reach
    the engine as the request's grammar (text: none); a schema, regular expression or grammar that does not compile
    against the model's vocabulary, a json_schema format without its schema object, two constraints at once and a
    tool whose parameters cannot be enforced under ``tool_choice`` required are 400s naming the field."""
    engine, post = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert post(CHAT, _body(CHAT, response_format={"type": "text"})).status_code == 200
    assert engine.seen[-1][1].grammar is None
    assert post(CHAT, _body(CHAT, response_format={"type": "json_object"})).status_code == 200
    assert engine.seen[-1][1].grammar.kind == "json_object"
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    assert post(CHAT, _body(CHAT, response_format=fmt)).status_code == 200
    spec = engine.seen[-1][1].grammar
    assert (spec.kind, json.loads(spec.source), spec.strict, spec.field) == ("json_schema", schema, True,
                                                                            "response_format")
    for path in (COMPLETIONS, CHAT):
        assert post(path, _body(path, regex="[a-z]+@x\\.com")).status_code == 200
        assert (engine.seen[-1][1].grammar.kind, engine.seen[-1][1].grammar.field) == ("regex", "regex")
        assert post(path, _body(path, ebnf='root ::= "yes" | "no"')).status_code == 200
        assert engine.seen[-1][1].grammar.kind == "ebnf"
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    for path, fields, param in (
            (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": {
                "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format"),
            (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
            (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
            (CHAT, {"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
            (COMPLETIONS, {"regex": "(ab"}, "regex"),
            (COMPLETIONS, {"ebnf": "root ::= b"}, "ebnf"),
            (CHAT, {"ebnf": "root ::= "}, "ebnf"),
            (CHAT, {"tools": bad_tool, "tool_choice": "required"}, "tools")):
        r = post(path, _body(path, **fields))
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (fields, r.text)
