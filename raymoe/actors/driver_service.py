"""DriverService: runs the Driver's step loop on a thread and streams per-request deltas to asyncio callers.

Ownership: the loop thread is the only code that touches the ``Driver`` (schedulers, radix caches, executor).
Callers submit ``add``/``abort`` commands through a thread-safe queue and read :class:`RequestDelta` records from
per-request asyncio queues. The same class serves in-process (offline engine, tests) and inside the driver's
Ray actor (``generate`` is then a Ray streaming generator).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from raymoe.actors.driver import Driver
from raymoe.errors import EngineUnhealthyError, RaymoeError
from raymoe.scheduler.req import Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.step_output import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestDelta:
    """New output of one request since its previous delta.

    Attributes:
        request_id: the caller's id.
        token_ids: tokens generated since the last delta. logprobs: one entry per token (None entries if not asked).
        finished: last delta of the request. finish_reason: ``"stop"`` | ``"length"`` | ``"abort"`` | ``"error"``.
        matched_stop: the stop string or token id that ended it, if any.
        prompt_tokens, completion_tokens, cached_tokens: usage counts so far (tokens).
        error: message when ``finish_reason == "error"`` (engine failure).
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """Snapshot for metrics: requests running/waiting (all DP groups), KV usage fraction (max over groups),
    radix-cache hit tokens, steps run, TBO steps, and per-rank last forward seconds."""

    num_running: int
    num_waiting: int
    kv_usage: float
    radix_hit_tokens: int
    num_steps: int
    num_tbo_steps: int
    healthy: bool
    step_seconds: list[float] = field(default_factory=list)


class _Stream:
    __slots__ = ("loop", "queue", "sent")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.sent = 0


class DriverService:
    """Owns a Driver and its step loop thread.

    After a failed step every in-flight request ends with an ``EngineUnhealthyError`` and the service reports
    unhealthy; with ``auto_recover`` the loop then restarts the rank group (``executor.restart()``) and clears
    the scheduler state, after which it is healthy again. Requests submitted while unhealthy are refused.

    Args:
        driver: the driver (already connected to its ranks).
        idle_sleep_s: how long the loop waits for new commands when there is no work, seconds.
        auto_recover: restart the rank group after a failure.
    """

    def __init__(self, driver: Driver, idle_sleep_s: float = 0.002, auto_recover: bool = True):
        self.driver = driver
        self.idle_sleep_s = idle_sleep_s
        self.auto_recover = auto_recover
        self.num_recoveries = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raymoe-driver-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread / event loop)
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestDelta]:
        """Submit a request and yield its deltas until it finishes.

        Raises:
            EngineUnhealthyError: the engine failed before or while serving the request.
            InvalidRequestError: the scheduler refused the request (names the field).
        """
        if self._error is not None:
            raise EngineUnhealthyError(self._error)
        stream = _Stream(asyncio.get_running_loop())
        accepted: asyncio.Future = stream.loop.create_future()
        self._commands.put(("add", request_id, list(prompt_token_ids), params, stream, accepted))
        await accepted
        try:
            while True:
                delta = await stream.queue.get()
                if delta.finish_reason == "error":
                    raise EngineUnhealthyError(delta.error or "engine failed")
                yield delta
                if delta.finished:
                    return
        finally:
            if request_id in self._streams:  # the caller stopped early (client went away)
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away); its KV is freed by the loop. Unknown ids are ignored."""
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        scheds = self.driver.schedulers
        return EngineStats(
            num_running=sum(s.num_running for s in scheds), num_waiting=sum(s.num_waiting for s in scheds),
            kv_usage=max(s.kv_usage() for s in scheds), radix_hit_tokens=sum(s.hit_tokens for s in scheds),
            num_steps=self.driver.num_steps, num_tbo_steps=self.driver.num_tbo_steps,
            healthy=self._error is None, step_seconds=list(self.driver.last_step_seconds))

    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ loop thread
    def _emit(self, stream: _Stream, delta: RequestDelta) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_sleep_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd[0] == "add":
                _, rid, ids, params, stream, accepted = cmd
                try:
                    if rid in self._streams:
                        raise ValueError(f"duplicate request id {rid!r}")
                    self.driver.add_request(rid, ids, params)
                    self._streams[rid] = stream
                    stream.loop.call_soon_threadsafe(_resolve, accepted, None)
                except (RaymoeError, ValueError) as e:
                    stream.loop.call_soon_threadsafe(_resolve, accepted, e)
            elif cmd[0] == "abort":
                rid = cmd[1]
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self.driver.abort_request(rid)
                    self._emit(stream, RequestDelta(rid, [], finished=True, finish_reason="abort"))
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, req: Req) -> None:
        stream = self._streams.get(req.rid)
        if stream is None:
            return
        new = req.output_ids[stream.sent:]
        lps = req.output_logprobs[stream.sent:]
        stream.sent = len(req.output_ids)
        reason = req.finished_reason
        delta = RequestDelta(
            req.rid, list(new), list(lps), finished=req.finished,
            finish_reason=reason.kind.value if reason else None, matched_stop=reason.matched if reason else None,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens)
        if req.finished:
            self._streams.pop(req.rid, None)
        self._emit(stream, delta)

    def _fail_all(self, message: str) -> None:
        self._error = message
        for rid, stream in list(self._streams.items()):
            self._emit(stream, RequestDelta(rid, [], finished=True, finish_reason="error", error=message))
        self._streams.clear()

    def _refuse_pending(self) -> None:
        """Answer queued commands while unhealthy: adds fail with EngineUnhealthyError, aborts are no-ops."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                stream, accepted = cmd[4], cmd[5]
                stream.loop.call_soon_threadsafe(_resolve, accepted, EngineUnhealthyError(self._error or ""))

    def _recover(self) -> None:
        try:
            self.driver.executor.restart()
        except Exception:  # noqa: BLE001 - stay unhealthy; try again later
            log.exception("restarting the rank group failed")
            self._stop.wait(5.0)
            return
        self.driver.reset()
        self.num_recoveries += 1
        self._error = None
        log.warning("rank group restarted; engine healthy again")

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._error is not None:
                self._refuse_pending()
                if self.auto_recover:
                    self._recover()
                else:
                    self._stop.wait(self.idle_sleep_s)
                continue
            busy = self.driver.has_unfinished()
            self._apply_commands(block=not busy)
            if not self.driver.has_unfinished():
                continue
            try:
                updated = self.driver.step()
            except Exception as e:  # noqa: BLE001 - a rank or the executor failed: fail requests, go unhealthy
                log.exception("driver step failed")
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                continue
            for req in updated:
                self._publish(req)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
