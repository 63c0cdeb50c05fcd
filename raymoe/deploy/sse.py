"""Server-sent events of one streamed request, relayed through a bounded backlog under the request's deadline.

Why a relay: the socket applies back-pressure, so without one a slow reader stops the event generator, and the
engine's tokens for it pile up unseen in the engine client's queue while the request keeps its KV until
``max_tokens``. :class:`EventRelay` reads the event source as fast as the engine produces, keeps the events not yet
written to the socket in a buffer it measures, and ends the request when

- that backlog stays over ``max_stream_backlog_events`` events or ``max_stream_backlog_bytes`` bytes for longer than
  ``stream_backlog_grace_s`` (a slow reader; the grace absorbs scheduling jitter, as when several engine steps
  arrive while the event loop was busy),
- the request's deadline passes (``timeout`` field or the server default),
- the source fails (an unexpected error: logged with its traceback under the request id).

Ending means closing the source, which aborts the request in the engine (its KV is freed at once), then one
``data: {"error": {...}}`` event with the request id and ``data: [DONE]``. What is already buffered is still
delivered first, but only for ``stream_drain_timeout_s``; then the connection is closed. Owned by ``openai_api``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from raymoe.deploy.http_errors import APIError, internal_error

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse(payload: dict | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass(frozen=True)
class StreamBounds:
    """Limits of one stream.

    Attributes:
        deadline: when generation must have ended, on ``anyio.current_time()``'s clock (seconds).
        max_events, max_bytes: largest backlog of events produced but not yet written to the socket (one event
            is always accepted into an empty backlog, whatever its size).
        backlog_grace_s: how long the backlog may stay full before the reader counts as slow, seconds.
        drain_timeout_s: how long the backlog may take to reach the client once generation has ended, seconds.
    """

    deadline: float
    max_events: int
    max_bytes: int
    backlog_grace_s: float
    drain_timeout_s: float

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.max_bytes < 1 or not self.backlog_grace_s > 0 or not self.drain_timeout_s > 0:
            raise ValueError(f"stream bounds must be positive: {self}")


class Backlog:
    """The events produced but not yet written: a FIFO with one producer (the relay's pump) and one consumer (the
    response), on the running asyncio loop (not thread-safe).

    Why not an ``anyio`` memory object stream: its ``receive`` passes through a checkpoint (one more event-loop
    turn) and makes an event and a waiter record through anyio's backend lookup for every event: 21 % of the front
    end's event-loop CPU per streamed token (``raymoe bench frontend`` under py-spy, 16 streams). Here a consumer
    that waits costs one future per event, one that finds events waiting costs nothing.
    """

    def __init__(self):
        self._items: collections.deque[bytes] = collections.deque()
        self._closed = False
        self._waiter: asyncio.Future | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def put(self, data: bytes) -> None:
        """Append ``data`` (never blocks; the relay bounds the backlog itself)."""
        self._items.append(data)
        self._wake()

    def close(self) -> None:
        """No more events: :meth:`get` returns None once the backlog is empty."""
        self._closed = True
        self._wake()

    async def get(self) -> bytes | None:
        """The oldest event, waiting for one; None after :meth:`close` once all were taken."""
        while not self._items:
            if self._closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class EventRelay:
    """Moves one request's SSE events from ``source`` to the response through a measured backlog.

    Args:
        source: the request's events (SSE text, the last one ``data: [DONE]``); closing it must abort the
            request in the engine.
        bounds: deadline and backlog limits. request_id: named in error events and log lines.

    Attributes:
        stopped: why the relay ended the request early: ``"timeout"``, ``"slow_reader"``, ``"error"`` or None.
    """

    def __init__(self, source: AsyncGenerator[str, None], bounds: StreamBounds, request_id: str):
        self.source = source
        self.bounds = bounds
        self.request_id = request_id
        self.stopped: str | None = None
        self.backlog_events = 0
        self.backlog_bytes = 0
        self._backlog = Backlog()
        self._delivery = anyio.CancelScope()
        self._taken = anyio.Event()  # set when the response takes an event from the backlog

    def _put(self, data: bytes) -> None:
        self.backlog_events += 1
        self.backlog_bytes += len(data)
        self._backlog.put(data)

    def _full(self, size: int) -> bool:
        b = self.bounds
        return self.backlog_events > 0 and (self.backlog_events >= b.max_events
                                            or self.backlog_bytes + size > b.max_bytes)

    async def _room_for(self, size: int) -> bool:
        """Wait up to ``backlog_grace_s`` for the backlog to take ``size`` more bytes; False if it did not."""
        with anyio.move_on_after(self.bounds.backlog_grace_s):
            while self._full(size):
                self._taken = anyio.Event()
                await self._taken.wait()
        return not self._full(size)

    def _error_event(self) -> bytes:
        b = self.bounds
        if self.stopped == "timeout":
            err = APIError(408, "the request's deadline passed; it was aborted", code="request_timeout")
        elif self.stopped == "slow_reader":
            err = APIError(400, f"the client read the stream too slowly (more than {b.max_events} events or "
                                f"{b.max_bytes} bytes not yet delivered); the request was aborted",
                           code="slow_reader")
        else:
            err = internal_error()
        return sse(err.body(self.request_id)).encode()

    async def _pump(self) -> None:
        b = self.bounds
        try:
            with anyio.CancelScope(deadline=b.deadline) as scope:
                async for event in self.source:
                    data = event.encode()
                    if self._full(len(data)) and not await self._room_for(len(data)):
                        self.stopped = "slow_reader"
                        break
                    self._put(data)
            if scope.cancelled_caught:
                self.stopped = "timeout"
        except Exception:  # noqa: BLE001 - a bug while streaming: the client gets the generic error event
            log.exception("stream of request %s failed with an unexpected error", self.request_id)
            self.stopped = "error"
        finally:
            with anyio.CancelScope(shield=True):
                await self.source.aclose()  # aborts the request in the engine when it did not finish
        if self.stopped is not None:
            log.info("stream of request %s ended early: %s", self.request_id, self.stopped)
            self._put(self._error_event())
            self._put(DONE)
        self._backlog.close()
        self._delivery.deadline = anyio.current_time() + b.drain_timeout_s

    async def events(self) -> AsyncIterator[bytes]:
        """The events to write, in order (the response's body iterator)."""
        while (data := await self._backlog.get()) is not None:
            self.backlog_events -= 1
            self.backlog_bytes -= len(data)
            self._taken.set()
            yield data

    async def run(self, respond: Callable[[], Awaitable[None]]) -> None:
        """Pump events while ``respond()`` writes :meth:`events` to the client; returns when the response is
        written, the client is gone, or the remaining events could not be delivered in ``drain_timeout_s``."""
        with self._delivery:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump)
                await respond()
                tg.cancel_scope.cancel()  # the client went away: stop generating
        if self._delivery.cancelled_caught:
            log.info("stream of request %s: the client did not read its last events in time", self.request_id)

    async def aclose(self) -> None:
        """Close the source (abort the request if it is still running); idempotent."""
        with anyio.CancelScope(shield=True):
            await self.source.aclose()


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response over an :class:`EventRelay`; ``on_close`` always runs when it ends (also
    when the client left before the first event)."""

    media_type = "text/event-stream"

    def __init__(self, relay: EventRelay, on_close: Callable[[], Awaitable[None]], **kwargs):
        super().__init__(relay.events(), **kwargs)
        self.relay = relay
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.relay.run(lambda: super(SSEResponse, self).__call__(scope, receive, send))
        finally:
            with anyio.CancelScope(shield=True):
                await self.relay.aclose()
                await self.on_close()
