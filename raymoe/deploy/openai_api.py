"""The OpenAI-compatible HTTP API over an :class:`~raymoe.client.engine_client.EngineClient` (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``), ``GET /v1/models``, ``POST
/tokenize`` and ``POST /detokenize`` (``tokenize_api``; these five need ``Authorization: Bearer KEY`` when an API
key is set), ``GET /ready`` and ``GET /health`` (readiness: 503
while the engine is unhealthy or the server drains), ``GET /live`` (liveness; ``probes``), ``GET /metrics``
(Prometheus text), the operator routes of ``admin`` (``GET /admin/expert_load``, ``POST
/admin/rebalance_experts``) and of ``weights_api`` (``POST /update_weights_from_disk``, ``GET
/get_weight_version``; the API key as on ``/v1/*``). ``drain.DrainGuard`` follows every ``/v1/*`` request so
that a stop can drain them (``drain.Drain``, kept in ``app.state.drain``). Flow of a request: ``http_guard`` gives
it an id and checks the key, the head and the declared body size before anything is read; ``request_body`` reads the
body (413 past ``max_body_bytes``) and has it parsed and validated under the structural limits, on the loop when it
is short, else in a parse worker process (any error: 400 naming the field); ``request_prep`` tokenizes it (on the
loop for a short body, else in a worker thread); ``generation.stream_pieces`` runs it in the engine under its
deadline (408 when it passes); ``responses`` shapes the answer, and a stream goes through ``sse.EventRelay``
(bounded backlog, deadline, error event). A client that disconnects aborts its request. At most ``max_in_flight``
generation requests are served at once; more get 429, as do requests the scheduler refuses because its queue is
full. README "Limits and failure behaviour" lists every limit and what a client sees.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from raymoe.client.engine_client import EngineClient
from raymoe.deploy.admin import admin_router
from raymoe.deploy.choices import choice_events, choice_prep, gather_all, merged_answer
from raymoe.deploy.drain import Drain, DrainGuard
from raymoe.deploy.drain_config import DrainConfig
from raymoe.deploy.generation import ClientDisconnected, Piece, collect, stream_pieces, until_disconnected
from raymoe.deploy.harmony import HarmonyChat
from raymoe.deploy.http_errors import (
    APIError,
    from_raymoe_error,
    install_error_handlers,
    model_not_found,
    request_id_of,
)
from raymoe.deploy.http_guard import RequestGuard
from raymoe.deploy.metrics import ServerMetrics
from raymoe.deploy.parse_pool import POOL
from raymoe.deploy.probes import liveness, readiness
from raymoe.deploy.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, PromptBatch
from raymoe.deploy.reasoning import ReasoningSplitter
from raymoe.deploy.request_body import body_schema, document_request_bodies, read_body, request_model
from raymoe.deploy.request_prep import PreparedRequest, constrained, prepare
from raymoe.deploy.responses import ResponseBuilder, TokenTexts
from raymoe.deploy.server_config import ServerLimits
from raymoe.deploy.sse import EventRelay, SSEResponse, StreamBounds, sse
from raymoe.deploy.tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from raymoe.deploy.tool_calls import ToolCallStreamer, default_tool_parser
from raymoe.deploy.weights_api import UpdateWeightsFromDiskRequest, weights_router
from raymoe.errors import InvalidRequestError, RaymoeError
from raymoe.runner.grammar_compiler import GrammarCompiler
from raymoe.step.grammar import GrammarSpec
from raymoe.tokenizer import eos_token_ids

# Largest request body prepared on the event loop rather than a worker thread (bytes). Handing a short prompt to
# a thread cost a median 15 ms (p90 52 ms) of time to first token under 16 streams (the thread and the loop wait
# for each other's GIL turns), while preparing a 350-character prompt takes 0.3 ms (completion) to 0.5 ms (chat
# template) on this project's CPU: a body of this size stalls the loop for about 1-2 ms at most.
INLINE_PREP_MAX_BODY_BYTES = 2048

# Status logged for requests whose client went away before the answer (nginx's convention; never seen by anyone).
_CLIENT_CLOSED = 499
_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 431, 500, 503)}


def _timed_out() -> APIError:
    return APIError(408, "the request's deadline passed before it finished; it was aborted",
                    param="timeout", code="request_timeout")


class OpenAIServing:
    """Request handling shared by the routes (one per app).

    Args:
        engine: the engine client.
        max_in_flight: generation requests served at once before 429 (None: derived from the scheduler limits).
        limits: per-request limits (None: the ``ServerLimits`` defaults).
        reasoning_parser: split chat answers' thinking into ``reasoning_content`` (``raymoe.deploy.reasoning``).
        tool_call_parser: the model's tool-call format (``raymoe.deploy.tool_calls``; ``auto``: from the model's
            family, none when unknown, and then requests with tools are refused). ``harmony`` (gpt-oss's ``auto``):
            chat prompts and outputs go through openai-harmony (``raymoe.deploy.harmony``).

    Raises:
        ValueError: ``tool_call_parser`` ``harmony`` for a model whose tokenizer is not harmony's, or without
            ``openai-harmony``.
        CheckpointError: a harmony model whose vocabulary openai-harmony cannot load.

    Why the default ``max_in_flight`` is ``dp_size * (max_running_requests + max_queued_requests)``: that is
    exactly how many requests the engine can hold at once (running plus queued over all DP groups); one more
    would be refused by the scheduler with "queue full" anyway, so the front end refuses it first (429
    ``too_many_requests``), before it costs a worker thread and a tokenization. Nothing else bounds a request in
    between: every request and abort travels to the driver actor over one Unix socket (``raymoe.actors.channel``),
    not as a Ray call of its own, so there is no per-call concurrency limit of an actor (``max_concurrency``) that
    the bound would also have to respect; one socket message per new request is all an admitted request costs
    before the scheduler sees it. A larger explicit value lets the scheduler's own 429 (``queue_full``) answer.
    """

    def __init__(self, engine: EngineClient, max_in_flight: int | None = None, limits: ServerLimits | None = None,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = "auto"):
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = (default_tool_parser(engine.model_config.model_type) if tool_call_parser == "auto"
                                 else tool_call_parser)
        self.harmony = None
        if self.tool_call_parser == "harmony":
            self.harmony = HarmonyChat.for_tokenizer(engine.tokenizer)
            if self.harmony is None and tool_call_parser == "harmony":
                raise ValueError("tool_call_parser harmony needs openai-harmony and a tokenizer with harmony's "
                                 "special tokens (the log says which is missing)")
            if self.harmony is None:  # auto: the chat template renders the chats, tools are refused
                self.tool_call_parser = None
        self.limits = limits or ServerLimits()
        sched, dp = engine.config.scheduler, engine.config.parallel.dp_size
        self.max_in_flight = max_in_flight or dp * (sched.max_running_requests + sched.max_queued_requests)
        self.in_flight = 0
        self.metrics = ServerMetrics(engine.model_name)
        self.token_texts = TokenTexts(engine.tokenizer, engine.model_config.vocab_size)
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request

    def _acquire(self, n: int = 1, param: str = "n") -> None:
        """Take ``n`` of the in-flight places (a request's choices, of each of its prompts, are engine requests
        each).

        Raises:
            APIError: 400 naming ``param`` when ``n`` exceeds every place there is; 429 when the places left are too
                few.
        """
        if n > self.max_in_flight:
            raise APIError(400, f"{param}: {n} choices are more than this server generates at once "
                                f"({self.max_in_flight})", param=param, code="invalid_value")
        if self.in_flight + n > self.max_in_flight:
            raise APIError(429, f"the server is busy ({self.in_flight} requests in flight); retry later",
                           code="too_many_requests")
        self.in_flight += n
        self.metrics.in_flight.set(self.in_flight)

    def _release(self, n: int = 1) -> None:
        self.in_flight -= n
        self.metrics.in_flight.set(self.in_flight)

    async def generate(self, request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        """Serve one completion or chat completion, streamed or not.

        Raises:
            APIError: 404 unknown model, 400 bad field, 408 deadline passed before the first token (or, not
                streamed, before the last), 429 busy, 503 engine unhealthy.
        """
        arrival = anyio.current_time()
        engine = self.engine
        if body.model != engine.model_name:
            raise model_not_found(body.model, engine.model_name)
        request_id = request_id_of(request) or uuid.uuid4().hex
        per_prompt = body.n or 1  # n > 1: one engine request per choice (raymoe.deploy.choices)
        batch = isinstance(body, CompletionRequest) and isinstance(body.prompt, PromptBatch)
        n = per_prompt * (len(body.prompt) if batch else 1)  # choice i: prompt i // per_prompt
        self._acquire(n, "prompt" if batch and per_prompt == 1 else "n")
        pieces = None
        handed_over = False  # a started stream belongs to its response, which closes it and releases the slot
        try:
            preps = await self._prepare_all(request, body) if batch else [await self._prepare(request, body)]
            deadline = arrival + preps[0].timeout_s
            builders = [self._builder(body, preps[i // per_prompt], request_id, i) for i in range(n)]
            builder = builders[0]
            for b in builders[1:]:
                b.created = builder.created
            streams = [stream_pieces(engine, builder.id if i == 0 else f"{builder.id}-{i}",
                                     choice_prep(preps[i // per_prompt], i % per_prompt), self.metrics.request())
                       for i in range(n)]
            pieces = streams[0]

            async def close_all() -> None:
                for s in streams:
                    await _close(s)

            with anyio.CancelScope(deadline=deadline) as scope:
                if body.stream and n == 1:
                    first = await until_disconnected(request, anext(pieces, None))
                elif body.stream:
                    firsts = await until_disconnected(request, gather_all([anext(s, None) for s in streams]))
                elif n == 1:
                    answer = builder.complete(await until_disconnected(request, collect(pieces)))
                else:
                    answer = merged_answer(builders, await until_disconnected(
                        request, gather_all([collect(s) for s in streams])), per_prompt)
            if scope.cancelled_caught:
                raise _timed_out()
            if not body.stream:
                return JSONResponse(answer)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            lim = self.limits
            bounds = StreamBounds(deadline, lim.max_stream_backlog_events, lim.max_stream_backlog_bytes,
                                  lim.stream_backlog_grace_s, lim.stream_drain_timeout_s)
            events = self._events(builder, first, pieces, include_usage, request_id) if n == 1 else choice_events(
                builders, firsts, streams, include_usage, request_id, close_all, per_prompt)
            relay = EventRelay(events, bounds, request_id)

            async def close_stream() -> None:
                await close_all()
                self._release(n)

            handed_over = True
            return SSEResponse(relay, on_close=close_stream,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)
        except RaymoeError as e:
            raise from_raymoe_error(e) from e
        finally:
            if not handed_over:
                if pieces is not None:
                    await close_all()  # aborts the requests in the engine that are still running
                self._release(n)

    def _builder(self, body: CompletionRequest | ChatCompletionRequest, prep: PreparedRequest, request_id: str,
                 index: int) -> ResponseBuilder:
        """The answer builder of choice ``index``, with its own reasoning splitter and tool-call parser."""
        splitter = None if prep.in_reasoning is None else ReasoningSplitter(self.reasoning_parser, prep.in_reasoning)
        harmony = self.harmony.stream(prep.tool_names) if prep.harmony_output else None
        tools = None if prep.tool_names is None or harmony is not None else ToolCallStreamer(
            self.tool_call_parser, prep.tool_names)
        scores = None if prep.prompt_logprobs is None else (prep.prompt_ids, prep.prompt_logprobs)
        return ResponseBuilder(isinstance(body, ChatCompletionRequest), self.engine.model_name, self.token_texts,
                               prep.logprobs, request_id, splitter, tools, prep.parallel_tool_calls, harmony, index,
                               scores)

    async def _prepare(self, request: Request, body: CompletionRequest | ChatCompletionRequest) -> PreparedRequest:
        """Template, tokenize and check ``body`` (``request_prep.prepare``). Their CPU cost grows with the prompt:
        a body of at most ``INLINE_PREP_MAX_BODY_BYTES`` is prepared on the event loop (well under 2 ms), a larger one
        (or one of unknown size) in a worker thread, so that a long prompt never stalls the other streams.

        Raises:
            APIError: 400 naming the field (from ``prepare``).
        """
        engine = self.engine
        args = (body, engine.tokenizer, engine.model_config.vocab_size, engine.max_context_len, self.limits,
                self.reasoning_parser, self.tool_call_parser, self.harmony)
        size = request.headers.get("content-length")
        if constrained(body):  # building and compiling a grammar: milliseconds, off the event loop (one hop)
            return await anyio.to_thread.run_sync(self._prepare_constrained, args)
        if size is not None and size.isdigit() and int(size) <= INLINE_PREP_MAX_BODY_BYTES:
            return prepare(*args)
        return await anyio.to_thread.run_sync(prepare, *args)

    async def _prepare_all(self, request: Request, body: CompletionRequest) -> list[PreparedRequest]:
        """:meth:`_prepare` for each prompt of a batch, in order.

        Raises:
            APIError: 400 naming ``prompt`` (the message names which one) or the field.
        """
        preps = []
        for i, prompt in enumerate(body.prompt):
            try:
                preps.append(await self._prepare(request, body.model_copy(update={"prompt": prompt})))
            except APIError as e:
                raise APIError(e.status, f"prompt[{i}]: {e.message}", e.param, e.code) from None
        return preps

    def _prepare_constrained(self, args: tuple) -> PreparedRequest:
        """``prepare`` and :meth:`_check_grammar` in one worker-thread call."""
        prep = prepare(*args)
        self._check_grammar(prep.params.grammar)
        return prep

    def _check_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` against the model's vocabulary (``raymoe.runner.grammar_compiler``; cached per source),
        so a schema, regular expression or grammar that cannot be enforced is a 400 here, not a failed request.

        Raises:
            APIError: 400 naming the field the constraint came from.
        """
        if self._grammars is None:
            engine = self.engine
            self._grammars = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                                             eos_token_ids(engine.model_config, engine.tokenizer))
        try:
            self._grammars.compile(spec)
        except InvalidRequestError as e:
            raise APIError(400, e.message, param=e.field, code="invalid_value") from None

    @staticmethod
    async def _events(builder: ResponseBuilder, first: Piece | None, pieces, include_usage: bool,
                      request_id: str):
        try:
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
                    yield sse(from_raymoe_error(e).body(request_id))
                    piece = None
                    break
            if include_usage and piece is not None:
                yield sse(builder.usage_chunk(piece))
            yield sse("[DONE]")
        finally:
            await _close(pieces)

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


async def _close(pieces) -> None:
    with anyio.CancelScope(shield=True):
        await pieces.aclose()


def build_openai_app(engine: EngineClient, api_key: str | None = None, max_in_flight: int | None = None,
                     limits: ServerLimits | None = None, drain: DrainConfig | None = None,
                     reasoning_parser: str | None = None, tool_call_parser: str | None = "auto") -> FastAPI:
    """The FastAPI app serving ``engine`` (see the module docstring for routes and status codes).

    Args:
        engine: the engine client. api_key: bearer token required on ``/v1/*`` and ``/admin/*`` (None: open).
        max_in_flight: see :class:`OpenAIServing`. limits: per-request limits (None: the defaults).
        drain: how a stop drains the app (None: the ``DrainConfig`` defaults).
        reasoning_parser: ``qwen3`` | ``deepseek_r1`` | None (``raymoe.deploy.reasoning``).
        tool_call_parser: ``auto`` | ``qwen3`` | ``deepseek_v3`` | ``mistral`` | None (``raymoe.deploy.tool_calls``).
    """
    from raymoe import __version__

    limits = limits or ServerLimits()
    serving = OpenAIServing(engine, max_in_flight=max_in_flight, limits=limits, reasoning_parser=reasoning_parser,
                            tool_call_parser=tool_call_parser)
    app = FastAPI(title="raymoe", version=__version__, description="OpenAI-compatible API of a raymoe engine")
    app.state.serving = serving
    app.state.drain = draining = Drain(drain)
    install_error_handlers(app, limits.max_body_bytes)
    app.add_middleware(DrainGuard, drain=draining)  # added first: inside RequestGuard, so refusals carry the id
    app.add_middleware(RequestGuard, metrics=serving.metrics, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                       max_headers=limits.max_headers, max_header_bytes=limits.max_header_bytes)
    document_request_bodies(app, (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                                  UpdateWeightsFromDiskRequest))
    body_limits = limits.body_limits()
    POOL.start()  # the parse workers import while the server starts

    async def parsed(request: Request, chat: bool) -> CompletionRequest | ChatCompletionRequest:
        return await request_model(request, chat, limits.max_body_bytes, body_limits)

    @app.post("/v1/completions", responses=_ERRORS, openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        """Text completion of one prompt (server-sent events when ``stream``)."""
        return await serving.generate(request, await parsed(request, chat=False))

    @app.post("/v1/chat/completions", responses=_ERRORS, openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        """Chat completion over the tokenizer's chat template (server-sent events when ``stream``)."""
        return await serving.generate(request, await parsed(request, chat=True))

    @app.post("/tokenize", responses=_ERRORS, openapi_extra=body_schema(TokenizeRequest))
    async def tokenize_route(request: Request):
        """Token ids of a prompt or a conversation, as the completion routes compute them (vLLM's route)."""
        body = b"".join(await read_body(request, limits.max_body_bytes))
        return await anyio.to_thread.run_sync(tokenize, body, engine.tokenizer, engine.model_name,
                                              engine.max_context_len, serving.harmony)

    @app.post("/detokenize", responses=_ERRORS, openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize_route(request: Request):
        """The text of token ids (vLLM's route)."""
        body = b"".join(await read_body(request, limits.max_body_bytes))
        return await anyio.to_thread.run_sync(detokenize, body, engine.tokenizer, engine.model_name,
                                              engine.model_config.vocab_size)

    @app.get("/v1/models", responses=_ERRORS)
    async def models():
        """The served model."""
        return serving.models()

    @app.get("/ready", responses={503: {"model": ErrorResponse}})
    async def ready(request: Request):
        """Readiness: 200 while the engine serves and the server admits requests; 503 while a failed rank group is
        being restarted or the server drains for a stop."""
        return await readiness(engine, draining, request_id_of(request))

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health(request: Request):
        """The same answer as ``/ready``."""
        return await readiness(engine, draining, request_id_of(request))

    @app.get("/live")
    async def live():
        """Liveness: 200 while the server answers (also while it drains or its engine recovers)."""
        return liveness(draining)

    @app.get("/metrics")
    async def metrics():
        """Prometheus metrics (``raymoe:`` prefix)."""
        return await serving.metrics_text()

    app.include_router(admin_router(engine, api_key))
    app.include_router(weights_router(engine, api_key, limits.max_body_bytes))
    return app
