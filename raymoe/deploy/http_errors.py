"""OpenAI-style error answers: ``{"error": {"message", "type", "param", "code", "request_id"}}`` for every
non-2xx status.

:class:`APIError` is what handlers raise; :func:`install_error_handlers` maps it, FastAPI's validation errors
(malformed JSON, wrong types: 400 instead of FastAPI's 422), Starlette's HTTP errors (unknown route 404, wrong
method 405, body too large 413) and raymoe's typed errors to that body. Anything unexpected is answered by
``http_guard.RequestGuard``: a generic 500 whose ``request_id`` names the traceback in the server log. Messages
are short and never carry internals (tracebacks, file paths, hosts, actor ids): those stay in the log.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from raymoe.errors import ContextLengthError, EngineUnhealthyError, InvalidRequestError, RequestFailedError

_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                   431: "invalid_request_error",
                   429: "rate_limit_error", 503: "service_unavailable_error"}
INTERNAL_ERROR_MESSAGE = "internal server error; quote the request id when you report it"
# Status logged and counted for a request whose client went away before its answer (nginx's convention; nobody
# receives it).
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete (answered ``CLIENT_CLOSED``)."""


class APIError(Exception):
    """An error answer.

    Args:
        status: HTTP status. message: human readable reason. param: the offending request field, if any.
        code: machine readable code (``"invalid_api_key"``, ``"model_not_found"`` ...). error_type: the
            body's ``type`` (default: derived from ``status``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type or _TYPE_OF_STATUS.get(status, "server_error")

    def body(self, request_id: str | None = None) -> dict:
        """The JSON body of this error (``request_id``: the request's id, see ``http_guard``)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          "request_id": request_id}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        """This error as a response (``WWW-Authenticate`` on 401)."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(request_id), status_code=self.status, headers=headers)


def request_id_of(request: Request) -> str | None:
    """The id ``http_guard.RequestGuard`` gave ``request`` (None outside the guard)."""
    return getattr(request.state, "request_id", None)


def internal_error() -> APIError:
    """The generic 500 a client sees for an unexpected failure (the details are logged under the request id)."""
    return APIError(500, INTERNAL_ERROR_MESSAGE, code="internal_error", error_type="server_error")


def from_raymoe_error(e: Exception) -> APIError:
    """Map raymoe's typed errors: a refused queue is 429, other bad fields 400, an unhealthy engine 503, anything
    else the generic 500 (the caller logs it)."""
    if isinstance(e, InvalidRequestError):
        if e.field == "queue":
            return APIError(429, f"the server is busy: {e.message}", code="queue_full")
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        return APIError(400, e.message, param=e.field, code=code)
    if isinstance(e, EngineUnhealthyError):
        return APIError(503, "the engine is unavailable (recovering from a failure); retry later",
                        code="engine_unhealthy")
    if isinstance(e, RequestFailedError):  # its message is written for clients: what failed, never how
        return APIError(500, f"the request failed in the engine: {e.message}", error_type="server_error",
                        code="request_failed")
    return internal_error()


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, "malformed JSON body", code="invalid_json")
    # Keep field names and list indices; drop pydantic's union-branch tags ("function-after[...]", "list[int]").
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not (isinstance(p, str) and "[" in p)]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}{more}", param=param,
                    code="invalid_value")


def model_not_found(model: str, served: str) -> APIError:
    """The 404 of a request naming ``model`` to a server that serves ``served``."""
    return APIError(404, f"the model {model!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


def body_too_large(max_body_bytes: int) -> APIError:
    """The 413 of a request body over ``max_body_bytes`` bytes."""
    return APIError(413, f"the request body is larger than {max_body_bytes} bytes", code="request_too_large")


def install_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    """Register the handlers that turn every expected error into the OpenAI error body (``max_body_bytes``: the
    body limit, named in the 413 message)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request_id_of(request))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response(request_id_of(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 413:  # FastAPI's body limit, hit while reading a chunked body
            return body_too_large(max_body_bytes).response(request_id_of(request))
        return APIError(exc.status_code, str(exc.detail)).response(request_id_of(request))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: logged and counted as a hang-up

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(EngineUnhealthyError)
    async def _raymoe_error(request: Request, exc: Exception) -> JSONResponse:
        return from_raymoe_error(exc).response(request_id_of(request))
