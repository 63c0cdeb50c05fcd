"""The first code every HTTP request meets: request ids, the API key, the body-size pre-check, and the last resort
for unexpected errors (an ASGI middleware, innermost of the user middlewares of the FastAPI app).

Order matters and is the point of this module:
1. the request gets an id (``uuid4`` hex, in ``request.state.request_id``; every answer carries it in the
   ``X-Request-Id`` header and every error body in ``error.request_id``);
2. on ``/v1/*``, ``/tokenize`` and ``/detokenize`` the API key is checked before a single body byte is read or
   parsed (401), so an unauthenticated client cannot make the server buffer or parse anything;
3. the head is checked: more than ``max_headers`` header fields or more than ``max_header_bytes`` bytes of them is
   a 431, a CR, LF or NUL inside a header value a 400 (under ``raymoe serve`` the HTTP protocol of
   ``http_protocol`` already refused such heads while they arrived; this catches them under any server);
4. a declared ``Content-Length`` over the limit is refused (413) before the body is read; a chunked body without
   one is cut off while it is read (``request_body``), also a 413;
5. an exception no handler mapped is logged with its traceback under the request id, and the client gets the
   generic 500 of ``http_errors.internal_error`` (never a traceback, a file path or an exception text).
Error answers (status >= 400) are counted in ``raymoe:request_errors_total`` (a client that hung up before its
answer is counted as 499, never as a 400).
"""

from __future__ import annotations

import logging
import secrets
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raymoe.deploy.http_errors import APIError, body_too_large, internal_error
from raymoe.deploy.metrics import ServerMetrics

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _auth_error(headers: Headers, api_key: str) -> APIError | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "incorrect API key", code="invalid_api_key")
    return None


def _declared_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


def _head_error(scope: Scope, max_headers: int, max_header_bytes: int) -> APIError | None:
    """431 for too many or too large headers, 400 for a CR, LF or NUL in one (O(headers))."""
    raw = scope["headers"]
    if len(raw) > max_headers:
        return APIError(431, f"at most {max_headers} header fields are allowed", code="too_many_headers")
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    for name, value in raw:
        size += len(name) + len(value) + 4
        if b"\r" in value or b"\n" in value or b"\0" in value:
            return APIError(400, f"the header {name.decode('latin-1')[:64]!r} holds a CR, LF or NUL",
                            code="invalid_header")
    if size > max_header_bytes:
        return APIError(431, f"the request head (request line and headers) is larger than {max_header_bytes} bytes",
                        code="request_header_too_large")
    return None


class RequestGuard:
    """ASGI middleware: request id, API key, head limits, body-size pre-check, error counting, catch-all 500.

    Args:
        app: the wrapped ASGI app. metrics: where error answers are counted.
        api_key: bearer token required on ``/v1/*`` (None: open). max_body_bytes: largest request body, bytes.
        max_headers: most header fields. max_header_bytes: largest request head, bytes.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int,
                 max_headers: int = 100, max_header_bytes: int = 64 * 1024):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes

    def _precheck(self, scope: Scope) -> APIError | None:
        if (err := _head_error(scope, self.max_headers, self.max_header_bytes)) is not None:
            return err
        headers = Headers(scope=scope)
        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIXES):
            if (err := _auth_error(headers, self.api_key)) is not None:
                return err
        length = _declared_length(headers)
        if length is not None and length > self.max_body_bytes:
            return body_too_large(self.max_body_bytes)
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def tagged_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER.lower().encode(), request_id.encode())]}
                if message["status"] >= 400:
                    self.metrics.error(message["status"])
            await send(message)

        refused = self._precheck(scope)
        if refused is not None:
            return await refused.response(request_id)(scope, receive, tagged_send)
        try:
            await self.app(scope, receive, tagged_send)
        except Exception:  # noqa: BLE001 - the last resort: log under the id, answer generically
            log.exception("request %s failed with an unexpected error", request_id)
            if not started:
                await internal_error().response(request_id)(scope, receive, tagged_send)
            # else the answer was under way: the server closes the connection.
