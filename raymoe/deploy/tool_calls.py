"""Tool calls in a model's output: found, parsed into the OpenAI shape, and held out of the streamed text.

With ``tools`` and ``tool_choice`` ``auto`` the chat template shows the model the tools (Hugging Face
``apply_chat_template(tools=...)``) and the model writes its calls in its family's format; this module reads them
back. The formats (as the families' chat templates and the peers' parsers define them):

- ``qwen3`` (Qwen2.5/Qwen3, Hermes style): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, text around them is content.
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``.
- ``mistral`` (Mistral/Mixtral): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

A call that does not parse (broken JSON, a name that is not one of the request's tools, an unclosed block) stays
in the content as text: the client sees what the model wrote, never a call it did not make. Streaming
(:class:`ToolCallStreamer`): text before a call's opening marker streams as content (a possible partial marker is
held back); from the marker on, the text is held and parsed when the output ends, and the calls go out then, each
whole (the OpenAI stream shape allows the arguments in one delta). Whitespace left between and after the calls is
dropped; a whole answer goes through the same streamer, so streamed and whole answers agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("qwen3", "deepseek_v3", "mistral", "harmony")
"""The ``--tool-call-parser`` choices (``harmony``: gpt-oss's chats, read from token ids by
``raymoe.deploy.harmony``, not by this module's text parsers)."""

_BY_MODEL_TYPE = {"qwen3_moe": "qwen3", "qwen3": "qwen3", "qwen2_moe": "qwen3", "qwen3_next": "qwen3",
                  "qwen3_5_moe": "qwen3", "qwen3_5_moe_text": "qwen3", "deepseek_v3": "deepseek_v3",
                  "deepseek_v2": "deepseek_v3", "mixtral": "mistral", "mistral": "mistral",
                  "gpt_oss": "harmony"}

_START = {"qwen3": "<tool_call>", "deepseek_v3": "<｜tool▁calls▁begin｜>", "mistral": "[TOOL_CALLS]"}

_QWEN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_DEEPSEEK_BLOCK = re.compile(r"<｜tool▁calls▁begin｜>(.*?)<｜tool▁calls▁end｜>", re.DOTALL)
_DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>([^\n]+)\n```json\n(.*?)\n```"
                            r"<｜tool▁call▁end｜>", re.DOTALL)


def default_tool_parser(model_type: str) -> str | None:
    """The parser of a model family (``config.json``'s ``model_type``), None when we know none."""
    return _BY_MODEL_TYPE.get(model_type)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is a JSON object as text (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict:
        """The ``tool_calls`` entry (a stream delta's carries ``index``)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ParsedOutput:
    """A model's output split into its content (text, calls removed) and its tool calls."""

    content: str
    calls: tuple[ToolCall, ...] = ()


def make_tool_call(name, arguments, names: frozenset[str]) -> ToolCall | None:
    """A call to one of ``names`` whose ``arguments`` (a dict, or its JSON text) are a JSON object, with a fresh id;
    None for anything else (it stays text)."""
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


def _json_call(text: str, names: frozenset[str]) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    return make_tool_call(obj.get("name"), obj.get("arguments", obj.get("parameters")), names)


def parse_tool_calls(parser: str, text: str, tool_names: frozenset[str]) -> ParsedOutput:
    """Find the calls in a whole output ``text`` (module docstring).

    Args:
        parser: a ``TOOL_CALL_PARSERS`` name. tool_names: the request's tools (a call to another name is text).

    Raises:
        ValueError: an unknown parser name.
    """
    if parser == "qwen3":
        calls, kept, at = [], [], 0
        for m in _QWEN.finditer(text):
            call = _json_call(m.group(1), tool_names)
            kept.append(text[at:m.start()] if call is not None else text[at:m.end()])
            at = m.end()
            if call is not None:
                calls.append(call)
        kept.append(text[at:])
        return ParsedOutput("".join(kept) if calls else text, tuple(calls))
    if parser == "deepseek_v3":
        block = _DEEPSEEK_BLOCK.search(text)
        if block is None:
            return ParsedOutput(text)
        calls = [make_tool_call(name.strip(), args, tool_names)
                 for name, args in _DEEPSEEK_CALL.findall(block.group(1))]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput(text[:block.start()] + text[block.end():], tuple(calls))
    if parser == "mistral":
        at = text.find(_START["mistral"])
        if at < 0:
            return ParsedOutput(text)
        try:
            items = json.loads(text[at + len(_START["mistral"]):].strip())
        except json.JSONDecodeError:
            return ParsedOutput(text)
        items = items if isinstance(items, list) else [items]
        calls = [make_tool_call(i.get("name"), i.get("arguments"), tool_names) if isinstance(i, dict) else None
                 for i in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput(text[:at], tuple(calls))
    raise ValueError(f"unknown tool-call parser {parser!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")


class ToolCallStreamer:
    """Streams content until a call's opening marker, then holds the rest for :meth:`finish` (module docstring).

    Args:
        parser: a ``TOOL_CALL_PARSERS`` name. tool_names: the request's tools.

    Raises:
        ValueError: an unknown parser name.
    """

    def __init__(self, parser: str, tool_names: frozenset[str]):
        if parser not in _START:
            raise ValueError(f"unknown tool-call parser {parser!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
        self.parser, self.tool_names = parser, tool_names
        self._marker = _START[parser]
        self._held = ""  # a possible partial marker, or (once it appeared) everything from the marker on
        self._in_call = False

    def feed(self, text: str) -> str:
        """The content of the next piece that can be shown now."""
        buf = self._held + text
        if self._in_call:
            self._held = buf
            return ""
        at = buf.find(self._marker)
        if at >= 0:
            self._in_call, self._held = True, buf[at:]
            return buf[:at]
        keep = next((n for n in range(min(len(self._marker) - 1, len(buf)), 0, -1)
                     if buf.endswith(self._marker[:n])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def finish(self) -> ParsedOutput:
        """The output ended: the held text parsed (its calls, and what is content after all)."""
        held, self._held = self._held, ""
        if not self._in_call:
            return ParsedOutput(held)
        parsed = parse_tool_calls(self.parser, held, self.tool_names)
        if parsed.calls and not parsed.content.strip():  # the whitespace between and after the calls
            return ParsedOutput("", parsed.calls)
        return parsed
