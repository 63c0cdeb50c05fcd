"""Tool calls read back from a model's output (``raymoe.deploy.tool_calls``): each family's format, what stays text
(broken JSON, a tool the request did not offer, an unclosed block), the parser a model family gets, and for any
cut of an output into stream pieces, the streamed content and calls equal the whole output's."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raymoe.deploy.tool_calls import ToolCallStreamer, default_tool_parser, parse_tool_calls

NAMES = frozenset({"get_weather", "get_time"})
OUTPUTS = {
    "qwen3": 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "deepseek_v3": "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
                   "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "mistral": 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {}}]',
}


@pytest.mark.parametrize("parser", OUTPUTS)
def test_each_family_format_gives_its_calls(parser):
    out = parse_tool_calls(parser, OUTPUTS[parser], NAMES)
    assert out.content.strip() == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Paris"}),
                                                                       ("get_time", {})]
    assert len({c.id for c in out.calls}) == 2


@pytest.mark.parametrize(("parser", "text"), [
    ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),  # broken JSON
    ("qwen3", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # not an offered tool
    ("qwen3", '<tool_call>\n{"name": "get_time", "arguments": {}}'),  # never closed
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n[1]\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),  # arguments not an object
])
def test_what_does_not_parse_stays_text(parser, text):
    out = parse_tool_calls(parser, text, NAMES)
    assert out.calls == () and out.content == text
    s = ToolCallStreamer(parser, NAMES)
    streamed = s.feed(text)
    rest = s.finish()
    assert rest.calls == () and streamed + rest.content == text


def test_parsers_by_model_family_and_unknown_names():
    assert [default_tool_parser(t) for t in ("qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss")] == [
        "qwen3", "deepseek_v3", "mistral", "harmony"]  # harmony: raymoe.deploy.harmony (test_harmony)
    assert default_tool_parser("llama") is None
    with pytest.raises(ValueError, match="tool-call parser"):
        ToolCallStreamer("hermes2", NAMES)
    with pytest.raises(ValueError, match="tool-call parser"):
        parse_tool_calls("hermes2", "x", NAMES)


@given(parser=st.sampled_from(sorted(OUTPUTS)), cuts=st.lists(st.integers(0, 400), max_size=10))
def test_streamed_pieces_give_the_whole_outputs_content_and_calls(parser, cuts):
    text = OUTPUTS[parser]
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    s = ToolCallStreamer(parser, NAMES)
    content = "".join(s.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    rest = s.finish()
    whole = ToolCallStreamer(parser, NAMES)
    want_content = whole.feed(text)
    want = whole.finish()
    assert content + rest.content == want_content + want.content == "Sure."
    assert [(c.name, c.arguments) for c in rest.calls] == [(c.name, c.arguments) for c in want.calls]
    assert len(rest.calls) == 2
