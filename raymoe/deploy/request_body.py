"""The body of a generation request: read within the size limit, parsed off the event loop, as a request model.

:func:`request_model` is what the ``/v1/completions`` and ``/v1/chat/completions`` routes call instead of letting
FastAPI parse the body (which parses and validates on the event loop). It reads the body (413 as soon as it passes
``max_body_bytes``, whether or not a ``Content-Length`` was sent), then parses it with ``parse_pool.parse_request``
(a short body on the loop, any other in a parse worker process) under the structural limits of ``ServerLimits``.
A client that hangs up before its body has arrived raises ``ClientDisconnected`` (answered 499: the status logged
and counted for a request whose client went away, never a 400).

:func:`document_request_bodies` puts the request models back into the OpenAPI schema, which FastAPI derives only
from the parameters it parses itself.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request

from raymoe.deploy.body_limits import BodyLimits, Refusal
from raymoe.deploy.http_errors import APIError, ClientDisconnected, body_too_large, internal_error, request_id_of
from raymoe.deploy.parse_pool import ParseWorkerError, parse_request
from raymoe.deploy.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


async def read_body(request: Request, max_body_bytes: int) -> list[bytes]:
    """The request body, read as it arrives, as its chunks (never joined here: a parse worker gets them as they are).

    Raises:
        APIError: 413 once more than ``max_body_bytes`` bytes arrived.
        ClientDisconnected: the client hung up before the body was complete.
    """
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise body_too_large(max_body_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected() from None
    return chunks


async def request_model(request: Request, chat: bool, max_body_bytes: int,
                        limits: BodyLimits) -> CompletionRequest | ChatCompletionRequest:
    """Read and parse the body of a generation request (see the module docstring).

    Raises:
        APIError: 413 (too large), 400 naming the field (a structural limit passed, a field refused by
            ``openai_fields``, a schema error, malformed JSON), 500 (a parse worker failed; logged).
        ClientDisconnected: the client hung up while sending the body.
    """
    body = await read_body(request, max_body_bytes)
    try:
        parsed = await parse_request(body, chat, limits)
    except ParseWorkerError:
        log.exception("request %s: parsing its body failed", request_id_of(request))
        raise internal_error() from None
    if isinstance(parsed, Refusal):
        raise APIError(parsed.status, parsed.message, param=parsed.param, code=parsed.code)
    return parsed


def body_schema(model: type) -> dict:
    """The ``openapi_extra`` of a route whose JSON body is ``model``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def document_request_bodies(app: FastAPI, models: tuple[type, ...]) -> None:
    """Add ``models`` (and the models they use) to the app's OpenAPI components, where :func:`body_schema` points."""
    make_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = make_schema()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            own = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(own.pop("$defs", {}))
            components[model.__name__] = own
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
