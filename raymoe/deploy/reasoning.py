"""Reasoning content: the thinking a reasoning model writes between ``<think>`` and ``</think>``, split from its
answer so that chat responses carry it as ``message.reasoning_content`` (``delta.reasoning_content`` when
streamed) and the answer as ``content``, as the OpenAI-compatible servers of the field do (vLLM's and SGLang's
``--reasoning-parser``).

Two conventions, chosen with ``raymoe serve --reasoning-parser``:

- ``qwen3``: the model opens its thinking itself with ``<think>`` (Qwen3's template with ``enable_thinking``), or
  the prompt already opened it; text before an opening tag is answer.
- ``deepseek_r1``: the chat template ends the prompt inside the thinking (``<think>\\n``), so the output starts as
  reasoning until ``</think>``, whether or not the model repeats the opening tag.

Either way, where the rendered prompt ends with an open ``<think>`` the output starts inside the thinking, and a
request whose template kept thinking off (``chat_template_kwargs: {"enable_thinking": false}``) is all answer. The
split is streamed: :class:`ReasoningSplitter` holds back only a possible partial tag at the end of what it has seen,
so the streamed pieces joined equal the whole answer's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""The ``--reasoning-parser`` choices."""

ReasoningParserName = Literal["qwen3", "deepseek_r1"]

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """The reasoning and the answer text of a piece of output (``""`` where it has none)."""

    reasoning: str = ""
    content: str = ""


def starts_in_reasoning(parser: str, prompt_text_tail: str) -> bool:
    """Whether the output starts inside the thinking: the rendered prompt ends with an open ``<think>`` (its last
    ``<think>`` comes after its last ``</think>``), or the ``deepseek_r1`` convention.

    Args:
        parser: a ``REASONING_PARSERS`` name. prompt_text_tail: the end of the rendered prompt's text (a few
            dozen characters are enough).
    """
    opened = prompt_text_tail.rfind(THINK_START) > prompt_text_tail.rfind(THINK_END)
    return opened or (parser == "deepseek_r1" and THINK_END not in prompt_text_tail)


class ReasoningSplitter:
    """Splits a stream of output text into reasoning and answer (module docstring).

    Args:
        parser: a ``REASONING_PARSERS`` name. in_reasoning: the output starts inside the thinking
            (:func:`starts_in_reasoning`).

    Raises:
        ValueError: an unknown parser name.
    """

    def __init__(self, parser: str, in_reasoning: bool):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose one of {', '.join(REASONING_PARSERS)}")
        self.parser = parser
        self._in = in_reasoning
        self._done = False  # the thinking ended: the rest is answer, tags included
        self._held = ""

    def feed(self, text: str) -> ReasoningSplit:
        """Split the next piece of output text; a possible partial tag at its end is held for the next call."""
        buf, reasoning, content = self._held + text, [], []
        self._held = ""
        while buf:
            if self._done:
                content.append(buf)
                break
            tag = THINK_END if self._in else THINK_START
            at = buf.find(tag)
            if at >= 0:
                (reasoning if self._in else content).append(buf[:at])
                buf = buf[at + len(tag):]
                if self._in:
                    self._done = True
                else:
                    self._in = True
                continue
            keep = _partial_suffix(buf, tag)
            (reasoning if self._in else content).append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            break
        return ReasoningSplit("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningSplit:
        """The text still held back (the output ended): it belongs where the stream was."""
        held, self._held = self._held, ""
        return ReasoningSplit(held, "") if self._in and not self._done else ReasoningSplit("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(parser: str, in_reasoning: bool, text: str) -> ReasoningSplit:
    """The split of a whole output ``text`` (a non-streamed answer): the same as streaming it piece by piece."""
    s = ReasoningSplitter(parser, in_reasoning)
    a, b = s.feed(text), s.finish()
    return ReasoningSplit(a.reasoning + b.reasoning, a.content + b.content)
