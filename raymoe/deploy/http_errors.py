"""OpenAI-style error answers: ``{"error": {"message", "type", "param", "code"}}`` for every non-2xx status.

:class:`APIError` is what handlers raise; :func:`install_error_handlers` maps it, FastAPI's validation errors
(malformed JSON, wrong types: 400 instead of FastAPI's 422), Starlette's HTTP errors (unknown route 404, wrong
method 405), raymoe's typed errors and anything unexpected (500) to that body.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from raymoe.errors import EngineUnhealthyError, InvalidRequestError

log = logging.getLogger(__name__)

_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                   503: "service_unavailable_error"}


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

    def body(self) -> dict:
        """The JSON body of this error."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as a response (``WWW-Authenticate`` on 401)."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_raymoe_error(e: Exception) -> APIError:
    """Map raymoe's typed errors: a refused queue is 429, other bad fields 400, an unhealthy engine 503."""
    if isinstance(e, InvalidRequestError):
        if e.field == "queue":
            return APIError(429, f"the server is busy: {e.message}", code="queue_full")
        code = "context_length_exceeded" if e.field == "prompt" and "context" in e.message else None
        return APIError(400, e.message, param=e.field, code=code)
    if isinstance(e, EngineUnhealthyError):
        return APIError(503, f"the engine is unavailable: {e}", code="engine_unhealthy")
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error", error_type="server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}{more}", param=param,
                    code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every error into the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(InvalidRequestError)
    async def _raymoe_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return from_raymoe_error(exc).response()

    @app.exception_handler(EngineUnhealthyError)
    async def _unhealthy(_: Request, exc: EngineUnhealthyError) -> JSONResponse:
        return from_raymoe_error(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request", exc_info=exc)
        return from_raymoe_error(exc).response()
