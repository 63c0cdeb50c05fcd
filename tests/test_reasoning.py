"""Reasoning content split from the answer (``raymoe.deploy.reasoning``): the rules of each parser, and for any
output cut into any pieces the streamed split joined equals the split of the whole (no tag leaks into either part,
no text is lost or duplicated)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raymoe.deploy.reasoning import ReasoningSplit, ReasoningSplitter, split_reasoning, starts_in_reasoning


@pytest.mark.parametrize(("parser", "in_reasoning", "text", "want"), [
    ("qwen3", False, "<think>\nhmm, fib</think>\n\ndef fib", ("\nhmm, fib", "\n\ndef fib")),
    ("qwen3", False, "no thinking at all", ("", "no thinking at all")),
    ("qwen3", True, "still thinking", ("still thinking", "")),
    ("deepseek_r1", True, "plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", True, "<think>plan</think>answer", ("<think>plan", "answer")),  # inside, an opening tag is text
    ("qwen3", False, "a</think>b", ("", "a</think>b")),  # a closing tag outside thinking is text
    ("qwen3", False, "<think>x</think>y<think>z", ("x", "y<think>z")),  # one thinking block, then answer
])
def test_each_parser_splits_as_its_models_write(parser, in_reasoning, text, want):
    got = split_reasoning(parser, in_reasoning, text)
    assert (got.reasoning, got.content) == want


def test_where_the_output_starts():
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n")
    assert not starts_in_reasoning("qwen3", "<think>\n\n</think>\n\n")  # thinking off: an empty block
    assert starts_in_reasoning("deepseek_r1", "<｜Assistant｜>")
    assert not starts_in_reasoning("deepseek_r1", "<｜Assistant｜><think>\n\n</think>")
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningSplitter("gpt", False)


_PIECES = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "b c", "\n", "<thi",
                                    "nk>", "</th"]), max_size=12)


@given(parts=_PIECES, cuts=st.lists(st.integers(0, 200), max_size=8), parser=st.sampled_from(["qwen3", "deepseek_r1"]),
       inside=st.booleans())
def test_streamed_pieces_join_to_the_whole_split(parts, cuts, parser, inside):
    text = "".join(parts)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    s = ReasoningSplitter(parser, inside)
    got = [s.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [s.finish()]
    joined = ReasoningSplit("".join(p.reasoning for p in got), "".join(p.content for p in got))
    assert joined == split_reasoning(parser, inside, text)
    # Nothing lost or duplicated: only the tags that opened and closed the thinking were consumed.
    consumed = len(text) - len(joined.reasoning) - len(joined.content)
    assert consumed in (0, len("<think>"), len("</think>"), len("<think></think>"))
