"""From the bytes of a request body to a validated request model, with bounded cost: :func:`parse_body`.

Order, cheapest refusal first:
1. split the body into its top-level fields, scanned but not built (``body_shape.split_body``);
2. count what a client chooses the size of (messages, content parts per message, token ids, ``logit_bias``
   entries) while parsing only their structure, and apply the OpenAI field rules to the raw spans
   (``body_shape.check_shape``): the huge bodies a hostile client sends are refused here, after parsing a bounded
   part of them;
3. build each field (msgspec) and check its nesting depth (``max_json_depth``), level by level, stopping at the
   limit;
4. validate the fields against the request model (``protocol``; pydantic), which checks types and ranges;
5. join each chat message's text parts, so what is returned holds one string per message (cheap to send back
   from a parse worker).

msgspec refuses some JSON that Python's ``json`` module reads (lone surrogate escapes, ``NaN``, numbers beyond a
float's range); such a body is read with ``json`` instead and goes through the same checks, so its error names
the field (a lone surrogate in ``prompt`` is a 400 ``param="prompt"``).

The front end runs :func:`parse_body` on its event loop for a short body and in a parse worker process for any
other (``parse_pool``). Light module: no torch, no Ray, no FastAPI.
"""

from __future__ import annotations

import json

import msgspec
from pydantic import ValidationError

from raymoe.deploy.body_limits import BodyLimits, Refusal
from raymoe.deploy.body_shape import check_shape, split_body
from raymoe.deploy.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, MESSAGE_FIELDS, RULED_MESSAGE_FIELDS
from raymoe.deploy.protocol import ChatCompletionRequest, CompletionRequest

_BUILD = msgspec.json.Decoder()
_NO_VALUE = object()


def _depth_refusal(name: str, value: object, limits: BodyLimits, raw: bytes | None = None) -> Refusal | None:
    """A 400 naming ``name`` when ``value`` (a top-level field: level 2) nests deeper than ``max_json_depth``.
    Breadth first, one level at a time, stopping at the limit; ``raw`` (its JSON text), when given, skips the walk
    for a value with too few brackets to be that deep."""
    limit = limits.max_json_depth
    if raw is not None and raw.count(b"[") + raw.count(b"{") <= limit - 1:
        return None
    level = [value] if type(value) in (list, dict) else []
    depth = 2
    while level:
        if depth > limit:
            return Refusal(f"{name}: nested more than {limit} levels deep, counting the body as level 1 "
                           f"(max_json_depth)", param=name, code="too_deep")
        nested = []
        for v in level:
            nested.extend([x for x in (v.values() if type(v) is dict else v) if type(x) is list or type(x) is dict])
        level = nested
        depth += 1
    return None


def _built_refusal(data: dict, chat: bool, limits: BodyLimits) -> Refusal | None:
    """The checks of ``body_shape.check_shape``, on a body already built by ``json`` (the fallback path)."""
    from raymoe.deploy.openai_fields import refusal_of

    messages, prompt, bias = data.get("messages"), data.get("prompt"), data.get("logit_bias")
    if chat and isinstance(messages, list):
        if len(messages) > limits.max_messages:
            return Refusal(f"messages: at most {limits.max_messages} messages per request (max_messages)",
                           param="messages", code="too_many_messages")
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), list) and \
                    len(m["content"]) > limits.max_message_parts:
                return Refusal(f"messages[{i}].content: at most {limits.max_message_parts} content parts per message "
                               f"(max_message_parts)", param="messages", code="too_many_content_parts")
            for name in RULED_MESSAGE_FIELDS:
                if isinstance(m, dict) and name in m and \
                        (r := refusal_of(MESSAGE_FIELDS[name], json.dumps(m[name]).encode(),
                                         f"messages[{i}].{name}", "messages")) is not None:
                    return r
    if not chat and isinstance(prompt, list):
        batch = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        if any(isinstance(p, list) and len(p) > limits.max_prompt_token_ids for p in batch):
            return Refusal(f"prompt: at most {limits.max_prompt_token_ids} token ids per prompt (max_prompt_token_ids)",
                           param="prompt", code="too_many_token_ids")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        return Refusal(f"logit_bias: at most {limits.max_logit_bias} entries (max_logit_bias)", param="logit_bias",
                       code="too_many_logit_bias_entries")
    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in data.items():
        if name in table and (r := refusal_of(table[name], json.dumps(value).encode(), name, name)) is not None:
            return r
    return None


def _read_with_json(body: bytes) -> object:
    """The body read by Python's ``json`` (which accepts what msgspec refuses: lone surrogates, ``NaN``)."""
    return json.loads(body)


def _build(body: bytes, chat: bool, limits: BodyLimits) -> dict | Refusal:
    """Steps 1-3 of the module docstring: the body's fields, built and checked, or the refusal."""
    try:
        fields = split_body(body)
    except msgspec.ValidationError:
        return Refusal("the body must be a JSON object", code="invalid_json")
    except RecursionError:
        return Refusal(f"the body nests arrays or objects more than {limits.max_json_depth} levels deep "
                       f"(max_json_depth)", code="too_deep")
    except msgspec.DecodeError:
        fields = None
    if fields is None:  # JSON msgspec does not read: read it with json, check the built values
        try:
            data = _read_with_json(body)
        except RecursionError:
            return Refusal(f"the body nests arrays or objects more than {limits.max_json_depth} levels deep "
                           f"(max_json_depth)", code="too_deep")
        except (ValueError, UnicodeDecodeError):
            return Refusal("malformed JSON body", code="invalid_json")
        if not isinstance(data, dict):
            return Refusal("the body must be a JSON object", code="invalid_json")
        if (refused := _built_refusal(data, chat, limits)) is not None:
            return refused
        for name, value in data.items():
            if (refused := _depth_refusal(name, value, limits)) is not None:
                return refused
        return data
    if (refused := check_shape(fields, chat, limits)) is not None:
        return refused
    data = {}
    for name, raw in fields.items():
        text = bytes(raw)
        try:
            value = _BUILD.decode(text)
        except RecursionError:
            value = _NO_VALUE
        except msgspec.DecodeError:
            try:
                value = json.loads(text)
            except RecursionError:
                value = _NO_VALUE
        if value is _NO_VALUE:
            return Refusal(f"{name}: nested more than {limits.max_json_depth} levels deep, counting the body as "
                           f"level 1 (max_json_depth)", param=name, code="too_deep")
        if (refused := _depth_refusal(name, value, limits, text)) is not None:
            return refused
        data[name] = value
    return data


def schema_refusal(e: ValidationError) -> Refusal:
    """The first schema error as a refusal naming the top-level field (and the path in the message)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    # Keep field names and list indices; drop pydantic's union-branch tags ("function-after[...]", "list[int]").
    loc = [str(p) for p in first.get("loc", ()) if not (isinstance(p, str) and "[" in p)]
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    msg = first.get("msg", "invalid value")
    if first.get("type") in ("token_id", "prompt"):
        return Refusal(f"{msg}{more}", param=loc[0] if loc else None)
    return Refusal(f"{where}: {msg}{more}", param=loc[0] if loc else None)


def parse_body(body: bytes, chat: bool, limits: BodyLimits) -> CompletionRequest | ChatCompletionRequest | Refusal:
    """Parse, bound and validate a request body (CPU work proportional to the part of the body it reads).

    Args:
        body: the raw body. chat: ``/v1/chat/completions`` (else ``/v1/completions``). limits: structural limits.

    Returns:
        The validated request (chat messages' text parts joined into one string each), or the :class:`Refusal`
        to answer (400 naming the field).
    """
    data = _build(body, chat, limits)
    if isinstance(data, Refusal):
        return data
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        return schema_refusal(e)
    if chat:
        for message in request.messages:
            if isinstance(message.content, list):
                message.content = message.text()
    return request
