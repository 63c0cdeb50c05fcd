"""Graceful drain of the HTTP front end: stop admitting, let the requests in flight finish, and end whatever is
left at the deadline with an error event instead of a cut connection.

Why: Kubernetes, systemd and Ray Serve stop a server with SIGTERM and a grace period (Kubernetes: 30 s by default).
Closing the listener and cancelling the open responses (uvicorn's own shutdown) cuts every stream mid-way, and a
client cannot tell a cut stream from a network fault.

Mechanism. :class:`DrainGuard`, an ASGI middleware just inside ``http_guard.RequestGuard`` (so every answer keeps
its request id), follows every API request (``/v1/*``) from its first byte to the last byte of its answer, inside
a cancel scope of its own. :meth:`Drain.run` then

1. refuses new API requests at once: 503 ``service_unavailable_error`` / ``server_shutdown`` with a
   ``Retry-After`` header, while ``/health``, ``/ready``, ``/live`` and ``/metrics`` keep answering (the listener
   stays open, so a load balancer sees the server unready instead of refused connections);
2. waits until the requests in flight have finished, for at most ``shutdown_timeout_s``;
3. cuts what is left: it cancels each request's scope (which aborts it in the engine and frees its KV, as a client
   disconnect does) and ends its answer itself: a stream that has started gets one
   ``data: {"error": {..., "code": "server_shutdown"}}`` event and ``data: [DONE]``; a request whose answer has not
   started gets the 503 above. Then it waits up to ``cut_grace_s`` for those last bytes to be written.
   :meth:`Drain.hurry` (a second signal) ends step 2 at once.

The caller (``raymoe serve``: ``deploy/shutdown.py``) closes the listener and stops the engine afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import anyio
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raymoe.deploy.drain_config import DrainConfig
from raymoe.deploy.http_errors import APIError
from raymoe.deploy.sse import DONE, sse

log = logging.getLogger(__name__)

_API_PREFIX = "/v1/"
SHUTDOWN_CODE = "server_shutdown"


@dataclass(frozen=True)
class DrainReport:
    """What a drain did.

    Attributes:
        in_flight: API requests in flight when the drain began.
        finished: of those, the ones that ended on their own before the deadline (completed, failed or left by
            their client).
        cut: the ones still running at the deadline, ended with the ``server_shutdown`` error.
        refused: new API requests answered 503 during the drain.
        seconds: how long the drain took.
        hurried: :meth:`Drain.hurry` ended the wait before the deadline.
    """

    in_flight: int
    finished: int
    cut: int
    refused: int
    seconds: float
    hurried: bool = False

    def summary(self) -> str:
        """One log line."""
        when = "when told to stop at once" if self.hurried else "at the deadline"
        return (f"drained in {self.seconds:.1f} s: {self.in_flight} requests in flight, {self.finished} finished, "
                f"{self.cut} cut {when} with a {SHUTDOWN_CODE} error; {self.refused} new requests refused")


def shutdown_error(message: str = "the server is shutting down; retry on another replica or later") -> APIError:
    """The 503 ``server_shutdown`` error of a refused or cut request."""
    return APIError(503, message, code=SHUTDOWN_CODE)


class _Tracked:
    """One API request followed by :class:`DrainGuard`."""

    __slots__ = ("scope", "cut")

    def __init__(self):
        self.scope = anyio.CancelScope()
        self.cut = False


class Drain:
    """The admission state of one front end (on its event loop; not thread-safe).

    Attributes:
        draining: True once :meth:`run` began (new API requests are refused, readiness answers 503).
        refused: API requests refused since then.
    """

    def __init__(self, config: DrainConfig | None = None):
        self.config = config or DrainConfig()
        self.draining = False
        self.refused = 0
        self.hurried = False
        self._active: set[_Tracked] = set()
        self._wake: asyncio.Event | None = None  # set when the last request leaves, or on hurry()

    @property
    def in_flight(self) -> int:
        """API requests being served now (from their first byte to the end of their answer)."""
        return len(self._active)

    def refusal(self, request_id: str | None) -> JSONResponse:
        """The 503 answer of a request that arrives during the drain (with ``Retry-After``)."""
        err = shutdown_error()
        return JSONResponse(err.body(request_id), status_code=503,
                            headers={"Retry-After": str(self.config.retry_after_s)})

    def _enter(self) -> _Tracked:
        t = _Tracked()
        self._active.add(t)
        return t

    def _leave(self, t: _Tracked) -> None:
        self._active.discard(t)
        if not self._active and self._wake is not None:
            self._wake.set()

    def hurry(self) -> None:
        """Stop waiting for the requests in flight: :meth:`run` cuts them now, as at the deadline (on the loop)."""
        self.hurried = True
        if self._wake is not None:
            self._wake.set()

    async def _wait_idle(self, timeout_s: float, until_hurried: bool) -> None:
        """Wait up to ``timeout_s`` until no request is in flight (or, with ``until_hurried``, :meth:`hurry`)."""
        self._wake = asyncio.Event()
        with anyio.move_on_after(timeout_s):
            while self._active and not (until_hurried and self.hurried):
                await self._wake.wait()
                self._wake.clear()

    async def run(self) -> DrainReport:
        """Drain: refuse new requests, wait up to ``shutdown_timeout_s`` for those in flight, cut the rest and
        wait up to ``cut_grace_s`` for their last events. Returns what happened."""
        start = time.monotonic()
        self.draining = True
        in_flight = len(self._active)
        await self._wait_idle(self.config.shutdown_timeout_s, until_hurried=True)
        left = list(self._active)
        for t in left:
            t.cut = True
            t.scope.cancel()
        if left:
            log.warning("%s: cutting %d requests", "told to stop at once" if self.hurried else
                        f"shutdown deadline ({self.config.shutdown_timeout_s:g} s) passed", len(left))
            await self._wait_idle(self.config.cut_grace_s, until_hurried=False)
        return DrainReport(in_flight, in_flight - len(left), len(left), self.refused, time.monotonic() - start,
                           self.hurried)


class _Progress:
    """How far an answer got: its start sent, the answer is an event stream, its last body part sent."""

    __slots__ = ("started", "stream", "ended")

    def __init__(self):
        self.started = self.stream = self.ended = False


class DrainGuard:
    """ASGI middleware: follows every ``/v1/*`` request for :class:`Drain` and refuses new ones while it drains.

    Args:
        app: the wrapped ASGI app. drain: the front end's drain state.
    """

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_API_PREFIX):
            return await self.app(scope, receive, send)
        request_id = scope.get("state", {}).get("request_id")
        drain = self.drain
        if drain.draining:
            drain.refused += 1
            return await drain.refusal(request_id)(scope, receive, send)
        progress = _Progress()

        async def watched_send(message: Message) -> None:
            await send(message)  # marked after sending: a send cancelled while it waited wrote nothing
            if message["type"] == "http.response.start":
                progress.started = True
                ctype = dict(message.get("headers", ())).get(b"content-type", b"")
                progress.stream = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                progress.ended = True

        tracked = drain._enter()
        try:
            with tracked.scope:
                await self.app(scope, receive, watched_send)
            if tracked.cut:
                await self._end_cut(progress, scope, receive, send, request_id)
        finally:
            drain._leave(tracked)

    async def _end_cut(self, progress: _Progress, scope: Scope, receive: Receive, send: Send,
                       request_id: str | None) -> None:
        """End the answer of a request cut at the deadline (its engine request is already aborted)."""
        if not progress.started:
            return await self.drain.refusal(request_id)(scope, receive, send)
        if progress.stream and not progress.ended:
            err = shutdown_error(f"the server shut down before this request finished (it did not finish within "
                                 f"the {self.drain.config.shutdown_timeout_s:g} s shutdown timeout); it was "
                                 f"aborted")
            await send({"type": "http.response.body", "body": sse(err.body(request_id)).encode() + DONE,
                        "more_body": False})
        # A plain answer already under way is written in one piece; nothing is left to end.
