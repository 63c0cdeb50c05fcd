"""One request through the engine: token deltas in, displayable :class:`Piece` records out.

:func:`stream_pieces` is the only place that talks to the ``EngineClient`` for a request. It detokenizes
incrementally, holds back possible stop-string prefixes, records the request's metrics, and guarantees that a
request that is not finished when its consumer goes away (client disconnect, cancelled task, a stop string found
here first) is aborted in the engine, which frees its KV. :func:`until_disconnected` runs an awaitable while
watching the HTTP connection and cancels it when the client leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from starlette.requests import Request

from raymoe.client.engine_client import EngineClient
from raymoe.deploy.detokenizer import IncrementalDetokenizer, StopStringFilter
from raymoe.deploy.http_errors import ClientDisconnected
from raymoe.deploy.metrics import RequestMetrics
from raymoe.deploy.request_prep import PreparedRequest
from raymoe.errors import EngineUnhealthyError, InvalidRequestError
from raymoe.step.step_output import TokenLogprobs

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Piece:
    """New output of a request.

    Attributes:
        text: text that may be shown now (never part of a matched stop string).
        token_ids: tokens generated since the previous piece. logprobs: one entry per token (or empty).
        finish_reason: ``"stop"`` | ``"length"`` | ``"abort"`` on the last piece, else ``None``.
        prompt_tokens, completion_tokens, cached_tokens: usage so far.
        accepted_prediction_tokens, rejected_prediction_tokens: speculative decoding's draft tokens the target
            accepted / rejected (on the last piece).
        prompt_logprobs: on the first piece of a request with the ``prompt_logprobs`` extension, the engine's
            prompt scores (one per prompt token, the first None).
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def engine_error(e: BaseException) -> BaseException:
    """The raymoe error behind ``e``: Ray wraps errors raised in the driver actor; a dead actor is unhealthy."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, (InvalidRequestError, EngineUnhealthyError)):
        return cause
    if isinstance(e, (InvalidRequestError, EngineUnhealthyError)):
        return e
    if type(e).__module__.startswith("ray."):
        # Ray's text carries tracebacks, hosts and actor ids: it goes to the log, not to the client.
        log.error("the engine's driver failed", exc_info=e)
        return EngineUnhealthyError(f"the engine's driver failed ({type(e).__name__})")
    return e


async def _abort_shielded(engine: EngineClient, request_id: str) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await engine.abort(request_id)
        except Exception:  # noqa: BLE001 - the engine is gone; nothing left to free
            log.warning("could not abort request %s", request_id, exc_info=True)


async def stream_pieces(engine: EngineClient, request_id: str, prep: PreparedRequest,
                        metrics: RequestMetrics) -> AsyncIterator[Piece]:
    """Generate ``prep`` and yield its pieces; the last has ``finish_reason`` set.

    Raises:
        InvalidRequestError: the engine refused the request (before any piece; ``"queue"`` when it is full).
        EngineUnhealthyError: the engine failed.
    """
    detok = IncrementalDetokenizer(engine.tokenizer)
    stops = StopStringFilter(prep.params.stop)
    engine_finished = counted = failed = False
    echo, first = prep.echo, True
    usage = (len(prep.prompt_ids), 0, 0, 0, 0)
    try:
        try:
            async for delta in engine.generate(request_id, prep.prompt_ids, prep.params):
                metrics.tokens(len(delta.token_ids))
                usage = (delta.prompt_tokens or usage[0], delta.completion_tokens, delta.cached_tokens,
                         delta.accepted_prediction_tokens, delta.rejected_prediction_tokens)
                engine_finished = delta.finished
                text = stops.push(detok.push(delta.token_ids, final=delta.finished), final=delta.finished)
                reason = "stop" if stops.matched is not None else (delta.finish_reason if delta.finished else None)
                if reason is not None:
                    metrics.finish(reason, usage[0], usage[1])
                    counted = True
                scored = delta.prompt_logprobs if first and prep.prompt_logprobs is not None else None
                piece = Piece(text, list(delta.token_ids), list(delta.logprobs) if prep.logprobs is not None else [],
                              reason, *usage, prompt_logprobs=scored)
                if echo is not None:  # the prompt opens the answer (raymoe.deploy.echo)
                    piece = echo.piece(piece, first, delta.prompt_logprobs, prep.logprobs)
                first = False
                yield piece
                if reason is not None:
                    return
        except Exception as e:
            failed = True  # refused (400/429) or the engine failed: not a finished request
            raise engine_error(e) from e
    finally:
        if not engine_finished:
            await _abort_shielded(engine, request_id)
        if not counted and not failed:  # the consumer went away (client disconnect)
            metrics.finish("abort", usage[0], usage[1])


async def collect(pieces: AsyncIterator[Piece]) -> list[Piece]:
    """All pieces of a request (for non-streaming answers)."""
    return [p async for p in pieces]


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read before the handler ran, so the next ASGI message is the disconnect (servers that answer
    # with other messages at once are polled instead of spun on).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
