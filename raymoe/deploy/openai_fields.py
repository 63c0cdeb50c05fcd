"""Every request field of the OpenAI API, classified: honoured, accepted only at its neutral value, or refused.

A client must never get silently different behaviour, so no OpenAI field is ignored: each field of the ``openai``
package's ``CompletionCreateParams`` and ``ChatCompletionCreateParams`` (and of each chat message type) is in one
of the tables below, and ``tests/test_openai_fields.py`` walks those parameter types so that a field a future
``openai`` release adds fails the test until it is classified here.

- ``honoured``: the server implements the field (the note says how); the pydantic models of ``protocol`` check
  its values.
- ``neutral``: accepted only at a value that asks for nothing the engine lacks (``best_of`` 1, ``echo``
  false ...); any other value is a 400 naming the field, code ``unsupported_value``.
- ``refused``: any value but ``null`` is a 400 naming the field, code ``unsupported_value``.

:func:`refusal_of` applies the rule of one field to its raw JSON bytes, as the body parser (``body_shape``) holds
them: neutral values are decoded only when the raw value is short, so a huge refused value costs nothing to refuse.
Light module (msgspec only): the parse workers import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from raymoe.deploy.body_limits import Refusal

# Longest raw JSON value compared against a field's neutral values (bytes); anything longer is not neutral.
_NEUTRAL_MAX_BYTES = 256


@dataclass(frozen=True)
class FieldRule:
    """How the server treats one request field.

    Attributes:
        status: ``honoured``, ``neutral`` or ``refused`` (see the module docstring).
        note: how it is honoured, or why it is refused (the refusal message's reason).
        neutral: the JSON values accepted for a ``neutral`` field (``null`` is always accepted).
    """

    status: Literal["honoured", "neutral", "refused"]
    note: str
    neutral: tuple = ()


def _h(note: str) -> FieldRule:
    return FieldRule("honoured", note)


def _n(note: str, *values) -> FieldRule:
    return FieldRule("neutral", note, values)


def _r(note: str) -> FieldRule:
    return FieldRule("refused", note)


_SHARED = {
    "model": _h("must name the served model (404 otherwise)"),
    "frequency_penalty": _h("subtracted from a token's logit once per occurrence in the output, in [-2, 2]"),
    "presence_penalty": _h("subtracted from the logit of every token the output holds, in [-2, 2]"),
    "logit_bias": _h("token id (a string) -> value in [-100, 100] added to its logit at every step"),
    "n": _h("choices per request, up to 128 (each its own generation; raymoe.deploy.choices)"),
    "seed": _h("seeds the request's sampler: the same seed and body give the same output"),
    "stop": _h("stop strings, cut from the output"),
    "stream": _h("server-sent events"),
    "stream_options": _h("include_usage adds a last chunk with the usage"),
    "temperature": _h("sampling temperature; 0 is greedy"),
    "top_p": _h("nucleus sampling"),
    "user": _h("an end-user id (for the operator's logs, as in OpenAI); it does not change the output"),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **_SHARED,
    "prompt": _h("text or token ids; one prompt per request"),
    "max_tokens": _h("tokens to generate (default 16); prompt + max_tokens must fit the context"),
    "logprobs": _h("top log-probabilities per generated token"),
    "best_of": _n("best_of is not supported; only 1 is accepted", 1),
    "echo": _h("the prompt opens the answer; with logprobs each prompt token is scored (raymoe.deploy.echo)"),
    "suffix": _n("suffix (insertion) is not supported; only an empty suffix is accepted", ""),
}
"""``POST /v1/completions``: the fields of ``openai.types.CompletionCreateParams``."""

CHAT_FIELDS: dict[str, FieldRule] = {
    **_SHARED,
    "messages": _h("rendered with the tokenizer's chat template (see MESSAGE_FIELDS)"),
    "max_tokens": _h("deprecated alias of max_completion_tokens"),
    "max_completion_tokens": _h("tokens to generate (default: the rest of the context); prompt + it must fit"),
    "logprobs": _h("log-probabilities of the generated tokens"),
    "top_logprobs": _h("top log-probabilities per generated token (needs logprobs)"),
    "safety_identifier": _h("an end-user id (for the operator's logs, as in OpenAI); it does not change the output"),
    "prompt_cache_key": _h("a prompt-cache hint; raymoe caches every prompt prefix by content, so it changes "
                           "nothing"),
    "tools": _h("shown to the model through the chat template; its calls are parsed from the output "
                "(raymoe.deploy.tool_calls) into message.tool_calls"),
    "tool_choice": _h("none, auto (the model decides), required or a named function (the answer is constrained "
                      "to calls whose arguments follow the tools' schemas: raymoe.deploy.tool_grammar)"),
    "parallel_tool_calls": _h("false keeps only the first call of an answer"),
    "functions": _n("function calling is not supported; only an empty list is accepted", []),
    "function_call": _n("function calling is not supported; only \"none\" is accepted", "none"),
    "response_format": _h("text, json_object or json_schema, enforced on the ranks by grammar-constrained "
                          "decoding (raymoe.runner.grammar)"),
    "modalities": _n("only text output is supported", ["text"]),
    "store": _n("completions are not stored; only false is accepted", False),
    "metadata": _n("completions are not stored, so metadata has no use; only an empty object is accepted", {}),
    "service_tier": _n("there is one service tier; only \"auto\" or \"default\" is accepted", "auto", "default"),
    "audio": _r("audio output is not supported"),
    "moderation": _r("moderation is not supported"),
    "prediction": _r("predicted outputs are not supported"),
    "prompt_cache_options": _r("prompt-cache options are not supported (prefixes are cached automatically)"),
    "prompt_cache_retention": _r("prompt-cache retention is not configurable"),
    "reasoning_effort": _h("harmony models (gpt-oss): the system message's reasoning effort (raymoe.deploy.harmony); "
                           "a 400 for other models"),
    "verbosity": _r("verbosity is not supported"),
    "web_search_options": _r("web search is not supported"),
}
"""``POST /v1/chat/completions``: the fields of ``openai.types.chat.ChatCompletionCreateParams``."""

MESSAGE_FIELDS: dict[str, FieldRule] = {
    "role": _h("system, developer, user, assistant or tool"),
    "content": _h("a string or a list of text parts (joined)"),
    "name": _h("passed to the chat template with the message"),
    "tool_calls": _h("an assistant turn's calls, passed to the chat template"),
    "function_call": _r("function calls are not supported"),
    "tool_call_id": _h("the call a tool turn answers, passed to the chat template"),
    "refusal": _r("assistant refusals in the history are not supported"),
    "audio": _r("audio is not supported"),
}
"""Fields of each chat message (the union ``openai.types.chat.ChatCompletionMessageParam``)."""

RULED_FIELDS = {name for table in (COMPLETION_FIELDS, CHAT_FIELDS) for name, rule in table.items()
                if rule.status != "honoured"}
"""Top-level fields the body parser checks against their rule (of either endpoint)."""
RULED_MESSAGE_FIELDS = tuple(name for name, rule in MESSAGE_FIELDS.items() if rule.status != "honoured")
"""Message fields the body parser checks against their rule."""


def _same(a, b) -> bool:
    """JSON equality: ``true`` is not ``1`` and ``0`` equals ``0.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) in (int, float) and type(b) in (int, float):
        return a == b
    return type(a) is type(b) is str and a == b


def refusal_of(rule: FieldRule, raw: bytes | memoryview | msgspec.Raw, where: str, param: str) -> Refusal | None:
    """The refusal of a field whose raw JSON value is ``raw`` under ``rule`` (``None``: accepted).

    Args:
        rule: the field's rule. raw: its JSON text (``null`` is always accepted). where: the field's path for the
            message (``"tools"``, ``"messages[2].tool_calls"``). param: the error's ``param``.
    """
    if rule.status == "honoured":
        return None
    text = bytes(raw).strip()
    if text == b"null":
        return None
    if rule.status == "neutral" and len(text) <= _NEUTRAL_MAX_BYTES:
        try:
            value = msgspec.json.decode(text)
        except (msgspec.DecodeError, RecursionError):
            value = msgspec.UNSET  # not JSON we can read: the schema check reports it
        if value is msgspec.UNSET or any(_same(value, v) for v in rule.neutral):
            return None
    return Refusal(f"{where}: {rule.note}", param=param, code="unsupported_value")
