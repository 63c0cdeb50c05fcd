"""The OpenAI-compatible HTTP API over an :class:`~raymoe.deploy.engine_client.EngineClient` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``), ``GET /v1/models`` (these
three need ``Authorization: Bearer KEY`` when an API key is set), ``GET /health`` (503 while the engine is
unhealthy), ``GET /metrics`` (Prometheus text). Flow of a request: pydantic validates the body (any error: 400),
``request_prep`` tokenizes it, ``generation.stream_pieces`` runs it in the engine, ``responses`` shapes the answer.
A client that disconnects aborts its request. At most ``max_in_flight`` generation requests are served at once;
more get 429, as do requests the scheduler refuses because its queue is full.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from raymoe.deploy.engine_client import EngineClient
from raymoe.deploy.generation import ClientDisconnected, Piece, collect, stream_pieces, until_disconnected
from raymoe.deploy.http_errors import APIError, from_raymoe_error, install_error_handlers
from raymoe.deploy.metrics import ServerMetrics
from raymoe.deploy.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from raymoe.deploy.request_prep import prepare
from raymoe.deploy.responses import ResponseBuilder, sse
from raymoe.errors import RaymoeError

# Status logged for requests whose client went away before the answer (nginx's convention; never seen by anyone).
_CLIENT_CLOSED = 499
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}


class _SSEResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` when it ends, also when the client disconnected
    before the first event was sent (an event generator that never started would not run its own cleanup)."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.on_close()


class _ErrorCounter:
    """ASGI middleware counting answers with status >= 400 in ``raymoe:request_errors_total``."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.error(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class OpenAIServing:
    """Request handling shared by the routes (one per app).

    Args:
        engine: the engine client. api_key: required bearer token (None: no authentication).
        max_in_flight: generation requests served at once before 429 (None: derived from the scheduler limits).
    """

    def __init__(self, engine: EngineClient, api_key: str | None = None, max_in_flight: int | None = None):
        self.engine = engine
        self.api_key = api_key
        sched, dp = engine.config.scheduler, engine.config.parallel.dp_size
        self.max_in_flight = max_in_flight or dp * (sched.max_running_requests + sched.max_queued_requests)
        self.in_flight = 0
        self.metrics = ServerMetrics(engine.model_name)

    def check_api_key(self, request: Request) -> None:
        """401 unless the request carries ``Authorization: Bearer <api_key>`` (when a key is set)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    def _acquire(self) -> None:
        if self.in_flight >= self.max_in_flight:
            raise APIError(429, f"the server is busy ({self.in_flight} requests in flight); retry later",
                           code="too_many_requests")
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def _release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)

    async def generate(self, request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        """Serve one completion or chat completion, streamed or not."""
        engine = self.engine
        if body.model != engine.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{engine.model_name!r}", param="model", code="model_not_found")
        chat = isinstance(body, ChatCompletionRequest)
        prep = prepare(body, engine.tokenizer, engine.model_config.vocab_size, engine.max_context_len)
        builder = ResponseBuilder(chat, engine.model_name, engine.tokenizer, prep.logprobs)
        self._acquire()
        released = False
        try:
            pieces = stream_pieces(engine, builder.id, prep, self.metrics.request())
            if not body.stream:
                return JSONResponse(builder.complete(await until_disconnected(request, collect(pieces))))
            first = await until_disconnected(request, anext(pieces, None))
            include_usage = body.stream_options is not None and body.stream_options.include_usage

            async def close_stream() -> None:
                await pieces.aclose()  # aborts the request if it is still running
                self._release()

            released = True  # the response releases the slot when the stream ends
            return _SSEResponse(self._events(builder, first, pieces, include_usage), on_close=close_stream,
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)
        except RaymoeError as e:
            raise from_raymoe_error(e) from e
        finally:
            if not released:
                self._release()

    @staticmethod
    async def _events(builder: ResponseBuilder, first: Piece | None, pieces, include_usage: bool):
        opening = builder.first_chunk()
        if opening is not None:
            yield sse(opening)
        piece = first or Piece("", [], finish_reason="abort")
        while True:
            chunk = builder.chunk(piece)
            if chunk is not None:
                yield sse(chunk)
            if piece.finish_reason is not None:
                break
            try:
                piece = await anext(pieces, None) or Piece("", [], finish_reason="abort")
            except RaymoeError as e:  # the engine failed mid-stream: the status is already 200
                yield sse(from_raymoe_error(e).body())
                piece = None
                break
        if include_usage and piece is not None:
            yield sse(builder.usage_chunk(piece))
        yield sse("[DONE]")

    async def health(self) -> Response:
        """200 while the engine is healthy, else 503."""
        try:
            ok = await asyncio.wait_for(self.engine.healthy(), timeout=10.0)
        except Exception:  # noqa: BLE001 - an unreachable or slow engine is unhealthy
            ok = False
        if not ok:
            raise APIError(503, "the engine is unhealthy (a rank failed; recovering)", code="engine_unhealthy")
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        """Prometheus exposition with the engine gauges fetched now."""
        try:
            stats = await asyncio.wait_for(self.engine.stats(), timeout=10.0)
        except Exception:  # noqa: BLE001 - export what the front end knows
            stats = None
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    def models(self) -> dict:
        """The ``/v1/models`` list (one model)."""
        e = self.engine
        return {"object": "list", "data": [{"id": e.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "raymoe", "max_model_len": e.max_context_len}]}


def build_openai_app(engine: EngineClient, api_key: str | None = None, max_in_flight: int | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (see the module docstring for routes and status codes)."""
    from raymoe import __version__

    serving = OpenAIServing(engine, api_key=api_key, max_in_flight=max_in_flight)
    app = FastAPI(title="raymoe", version=__version__, description="OpenAI-compatible API of a raymoe engine")
    app.state.serving = serving
    install_error_handlers(app)
    app.add_middleware(_ErrorCounter, metrics=serving.metrics)

    def authorized(request: Request) -> None:
        serving.check_api_key(request)

    auth = [Depends(authorized)]

    @app.post("/v1/completions", dependencies=auth, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        """Text completion of one prompt (server-sent events when ``stream``)."""
        return await serving.generate(request, body)

    @app.post("/v1/chat/completions", dependencies=auth, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Chat completion over the tokenizer's chat template (server-sent events when ``stream``)."""
        return await serving.generate(request, body)

    @app.get("/v1/models", dependencies=auth, responses=_ERRORS)
    async def models():
        """The served model."""
        return serving.models()

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        """200 while every rank is up; 503 while a failed rank group is being restarted."""
        return await serving.health()

    @app.get("/metrics")
    async def metrics():
        """Prometheus metrics (``raymoe:`` prefix)."""
        return await serving.metrics_text()

    return app
