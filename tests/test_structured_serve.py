"""Structured outputs through the OpenAI app on dp=2 x ep=2 rank actors (``raymoe serve``'s default topology),
driven by the official ``openai`` client: ``chat.completions.parse`` with a pydantic ``response_format``, streamed
and not, 50 of 50 valid; ``tool_choice="required"`` over three tools of different schemas, every call's arguments
valid under its tool's schema, 50 of 50, and the streamed deltas joining to the whole answer's calls for a seed.

The tiny model writes noise: the grammar alone makes the answers valid. Its schemas bound every string and array so
that every document the grammar allows ends within the token budget (with an unbounded string a model may never
close it, under any engine).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from server_harness import uvicorn_server

N = 50


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    role: str = Field(pattern=r"^(admin|editor|viewer)$")
    address: Address
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)
    active: bool


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -50, "maximum": 50},
                                         "b": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_flags", "parameters": {
        "type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                                         "label": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
        "required": ["flags"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(ray_cluster, tiny_model):
    from raymoe.client.engine_client import EngineClient
    from raymoe.config import engine_config_from_options
    from raymoe.deploy.openai_api import build_openai_app

    options = {"dp_size": 2, "ep_size": 2, "max_context_len": 512, "max_running_requests": 16}
    engine = EngineClient(engine_config_from_options(tiny_model, options), model_name="tiny")
    try:
        with uvicorn_server(build_openai_app(engine)) as url:
            yield OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        engine.shutdown()


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe person number {i} as JSON."}]


def test_parse_validates_50_of_50_streamed_and_not(client):
    def whole(i: int) -> Person:
        r = client.chat.completions.parse(model="tiny", messages=_messages(i), response_format=Person,
                                          temperature=1.0, seed=i, max_tokens=300)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.parsed

    def streamed(i: int) -> Person:
        with client.chat.completions.stream(model="tiny", messages=_messages(i), response_format=Person,
                                            temperature=1.0, seed=i, max_tokens=300) as s:
            final = s.get_final_completion()
        return final.choices[0].message.parsed

    with ThreadPoolExecutor(8) as pool:
        parsed = list(pool.map(whole, range(N)))
        parsed_streamed = list(pool.map(streamed, range(N)))
    assert all(isinstance(p, Person) for p in parsed) and len(parsed) == N
    assert all(isinstance(p, Person) for p in parsed_streamed) and len(parsed_streamed) == N
    assert parsed_streamed == parsed  # same seed, same document
    assert len({p.model_dump_json() for p in parsed}) > N // 2


def _tool_answer(client, i: int, stream: bool) -> tuple[list[tuple[str, str]], str | None]:
    kw = dict(model="tiny", messages=[{"role": "user", "content": f"task {i}"}], tools=TOOLS, tool_choice="required",
              temperature=1.0, seed=i, max_tokens=300)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += (d.function.name or "") if d.function else ""
                entry[1] += (d.function.arguments or "") if d.function else ""
            finish = c.finish_reason or finish
    return [tuple(calls[k]) for k in sorted(calls)], finish


def test_required_tool_calls_validate_against_their_tools_50_of_50(client):
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _tool_answer(client, i, False), range(N)))
    names = set()
    for calls, finish in answers:
        assert finish == "tool_calls" and calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            names.add(name)
    assert len(names) >= 2  # the model picks among the tools
    for i in range(4):
        assert _tool_answer(client, i, True) == answers[i]


def test_a_named_tool_choice_calls_that_tool(client):
    choice = {"type": "function", "function": {"name": "add"}}
    for i in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "sum"}], tools=TOOLS,
                                           tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=i,
                                           max_tokens=200)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["add"]
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["add"])


def test_regex_and_ebnf_extensions_on_completions(client):
    r = client.completions.create(model="tiny", prompt="mail:", max_tokens=40, temperature=1.0, seed=3,
                                  extra_body={"regex": "[a-z]{3,6}@example\\.(com|org)"})
    import re

    assert re.fullmatch("[a-z]{3,6}@example\\.(com|org)", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="ok?", max_tokens=10, temperature=1.0, seed=1,
                                  extra_body={"ebnf": 'root ::= "yes" | "no" | "maybe"'})
    assert r.choices[0].text in ("yes", "no", "maybe")
