"""The structural pass over a request body: count what a body holds before anything is built (msgspec).

:func:`split_body` splits the body into its top-level fields as raw JSON spans (``msgspec.Raw``: scanned, never
built). :func:`check_shape` then decodes only the structure of the fields whose size a client chooses, against
typed shapes whose lists and objects carry the operator's limits (``BodyLimits``): msgspec refuses a list longer
than its bound while it parses it, so a body of 142 messages of 4,096 parts each is refused after its first
message (about 0.4 ms for 15 MB) instead of being built in full (about 2 s). Every other JSON type is accepted at
these positions (``str | int | float | bool | None`` beside the counted container), so a value of the wrong
type passes this pass untouched and is reported by the schema check (``protocol``), with its field.

The rules of ``openai_fields`` are applied here too, on the raw spans: a refused field costs no parse.
Errors are :class:`~raymoe.deploy.body_limits.Refusal` records naming the field (``param``). Light module.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Union

import msgspec
from msgspec import Meta, Raw

from raymoe.deploy.body_limits import MAX_BATCH_PROMPTS, BodyLimits, Refusal
from raymoe.deploy.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, MESSAGE_FIELDS, RULED_MESSAGE_FIELDS, refusal_of

_SCALARS = (str, int, float, bool, None)
# msgspec's message for a list or object past its bound: "Expected `array` of length <= N[ - at `$[i].content`]".
_LENGTH_ERROR = re.compile(r"length <= (\d+)(?:$| - at `\$((?:\[\d+\])?)(\.content)?`$)")


def _tolerant(counted, other_container) -> object:
    """``counted`` or any other JSON type (``other_container``: the container kind ``counted`` is not)."""
    return Union[(counted, other_container, *_SCALARS)]  # noqa: UP007 - built at run time


@functools.lru_cache(maxsize=16)
def _decoders(limits: BodyLimits) -> dict[str, msgspec.json.Decoder]:
    """The shape decoders of ``limits``, per counted field."""
    message = msgspec.defstruct(
        "MessageShape",
        [("content", _tolerant(Annotated[list[Raw], Meta(max_length=limits.max_message_parts)], dict[str, Raw]),
          None),
         *((name, Raw, msgspec.field(default_factory=Raw)) for name in RULED_MESSAGE_FIELDS)])
    messages = _tolerant(Annotated[list[_tolerant(message, list[Raw])], Meta(max_length=limits.max_messages)],
                         dict[str, Raw])
    token_ids = Annotated[list[Raw], Meta(max_length=limits.max_prompt_token_ids)]
    prompt = _tolerant(Annotated[list[_tolerant(token_ids, dict[str, Raw])],
                                 Meta(max_length=limits.max_prompt_token_ids)], dict[str, Raw])
    logit_bias = _tolerant(Annotated[dict[str, Raw], Meta(max_length=limits.max_logit_bias)], list[Raw])
    return {"messages": msgspec.json.Decoder(messages), "prompt": msgspec.json.Decoder(prompt),
            "logit_bias": msgspec.json.Decoder(logit_bias)}


_TOP = msgspec.json.Decoder(dict[str, Raw])


def split_body(body: bytes) -> dict[str, Raw]:
    """The body's top-level fields as raw JSON spans (scanned, not built).

    Raises:
        msgspec.DecodeError: not JSON msgspec reads (malformed, or escapes such as lone surrogates it refuses).
        msgspec.ValidationError: the body is not a JSON object.
        RecursionError: nested beyond the decoder's recursion guard.
    """
    return _TOP.decode(body)


def _limit_refusal(field: str, message: str, limits: BodyLimits) -> Refusal | None:
    """The refusal for a length error of msgspec (``None``: another error, left to the schema check)."""
    m = _LENGTH_ERROR.search(message)
    if m is None:
        return None
    index, content = m.group(2) or "", m.group(3)
    if field == "messages" and content:
        return Refusal(f"messages{index}.content: at most {limits.max_message_parts} content parts per message "
                       f"(max_message_parts)", param="messages", code="too_many_content_parts")
    if field == "messages" and not index:
        return Refusal(f"messages: at most {limits.max_messages} messages per request (max_messages)",
                       param="messages", code="too_many_messages")
    if field == "prompt":
        return Refusal(f"prompt{index}: at most {limits.max_prompt_token_ids} token ids per prompt "
                       f"(max_prompt_token_ids)", param="prompt", code="too_many_token_ids")
    if field == "logit_bias" and not index:
        return Refusal(f"logit_bias: at most {limits.max_logit_bias} entries (max_logit_bias)",
                       param="logit_bias", code="too_many_logit_bias_entries")
    return None


def _message_refusal(messages: object) -> Refusal | None:
    if not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        for name in RULED_MESSAGE_FIELDS:
            raw = getattr(message, name, None)
            if raw is not None and len(raw):
                refused = refusal_of(MESSAGE_FIELDS[name], raw, f"messages[{i}].{name}", "messages")
                if refused is not None:
                    return refused
    return None


def check_shape(fields: dict[str, Raw], chat: bool, limits: BodyLimits) -> Refusal | None:
    """Check the counted fields of a split body against ``limits``, then every field against its rule.

    Args:
        fields: the body's top-level fields (:func:`split_body`). chat: a chat completion (else a completion).
        limits: the operator's structural limits.

    Returns:
        The first refusal (a limit passed, or a field refused by ``openai_fields``), or ``None``.
    """
    decoders = _decoders(limits)
    shapes = {}
    for name in ("messages",) if chat else ("prompt",):
        if name in fields:
            try:
                shapes[name] = decoders[name].decode(fields[name])
            except msgspec.ValidationError as e:
                if (refused := _limit_refusal(name, str(e), limits)) is not None:
                    return refused
            except msgspec.DecodeError:
                pass  # malformed or unreadable: the full decode reports it
    if "logit_bias" in fields:
        try:
            decoders["logit_bias"].decode(fields["logit_bias"])
        except msgspec.ValidationError as e:
            if (refused := _limit_refusal("logit_bias", str(e), limits)) is not None:
                return refused
        except msgspec.DecodeError:
            pass
    prompt = shapes.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_BATCH_PROMPTS and isinstance(prompt[0], (str, list)):
        return Refusal(f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request", param="prompt",
                       code="too_many_prompts")
    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, raw in fields.items():
        rule = table.get(name)
        if rule is not None and (refused := refusal_of(rule, raw, name, name)) is not None:
            return refused
    return _message_refusal(shapes.get("messages")) if chat else None
