"""DriverService: runs the Driver's step loop on its own thread and publishes one batched message per step.

Ownership: the loop thread is the only code that touches the ``Driver`` (schedulers, radix caches, executor).
Callers hand it work with :meth:`DriverService.submit` (thread-safe, many adds and aborts at once) and receive
results through the ``publish`` callback: once per loop iteration, with the :class:`RequestDelta` of every request
that got tokens, finished, was refused or failed in that iteration (an :class:`OutputBatch`). So the cost of
talking to the front end is one message per step, not one per request and token.

In a server the service lives in the driver's own process (``raymoe.actors.driver_actor.DriverActor``), never in
the HTTP process: a Python loop doing per-token work next to the engine would take its GIL.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from raymoe.actors.driver import Driver
from raymoe.errors import EngineUnhealthyError, InvalidRequestError, RaymoeError
from raymoe.scheduler.req import Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.step_output import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestError:
    """Why a request ended without a result.

    Attributes:
        kind: ``"invalid"`` (the scheduler refused the request; ``field`` names why, ``"queue"`` when full) or
            ``"unhealthy"`` (the engine failed or is recovering).
        message: human readable reason. field: the offending field for ``"invalid"``.
    """

    kind: str
    message: str
    field: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("invalid", "unhealthy"):
            raise ValueError(f"RequestError.kind must be 'invalid' or 'unhealthy', got {self.kind!r}")

    def to_exception(self) -> RaymoeError:
        """The typed error a caller raises for this record."""
        if self.kind == "invalid":
            return InvalidRequestError(self.field or "request", self.message)
        return EngineUnhealthyError(self.message)


@dataclass(frozen=True)
class RequestDelta:
    """New output of one request since its previous delta.

    Attributes:
        request_id: the caller's id.
        token_ids: tokens generated since the last delta. logprobs: one entry per token (None entries if not asked).
        finished: last delta of the request (also set with ``error``).
        finish_reason: ``"stop"`` | ``"length"`` | ``"abort"`` when finished normally, else ``None``.
        matched_stop: the stop string or token id that ended it, if any.
        prompt_tokens, completion_tokens, cached_tokens: usage counts so far (tokens).
        error: set when the request was refused or the engine failed (then ``finished`` and no tokens).
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
    error: RequestError | None = None


OutputBatch = list[RequestDelta]
"""One message from the driver to the front end: the deltas of one loop iteration (any number of requests)."""


@dataclass(frozen=True)
class AddRequest:
    """A request handed to the driver: the caller's id, prompt token ids and validated sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class EngineStats:
    """Snapshot for metrics: requests running/waiting (all DP groups), KV usage fraction (max over groups),
    radix-cache hit tokens, steps run, TBO steps, health, and per-rank last forward seconds."""

    num_running: int
    num_waiting: int
    kv_usage: float
    radix_hit_tokens: int
    num_steps: int
    num_tbo_steps: int
    healthy: bool
    step_seconds: list[float] = field(default_factory=list)


class DriverService:
    """Owns a Driver and its step loop thread.

    After a failed step every in-flight request ends with an ``"unhealthy"`` error and the service reports
    unhealthy; with ``auto_recover`` the loop then restarts the rank group (``executor.restart()``) and clears
    the scheduler state, after which it is healthy again. Requests submitted while unhealthy are refused.

    Args:
        driver: the driver (already connected to its ranks).
        publish: called on the loop thread with each non-empty :data:`OutputBatch`; it must not block (hand the
            batch to another thread or event loop).
        idle_sleep_s: how long the loop waits for new work when there is none, seconds.
        auto_recover: restart the rank group after a failure.
    """

    def __init__(self, driver: Driver, publish: Callable[[OutputBatch], None], idle_sleep_s: float = 0.005,
                 auto_recover: bool = True):
        self.driver = driver
        self.publish = publish
        self.idle_sleep_s = idle_sleep_s
        self.auto_recover = auto_recover
        self.num_recoveries = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sent: dict[str, int] = {}  # in-flight request id -> output tokens already published
        self._out: OutputBatch = []
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raymoe-driver-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, adds: Sequence[AddRequest] = (), aborts: Sequence[str] = ()) -> None:
        """Queue new requests and aborts (applied in that order, at the start of the next loop iteration).
        A refused add is answered by a delta with ``error`` set; unknown abort ids are ignored."""
        if adds or aborts:
            self._commands.put((list(adds), list(aborts)))

    def stats(self) -> EngineStats:
        scheds = self.driver.schedulers
        return EngineStats(
            num_running=sum(s.num_running for s in scheds), num_waiting=sum(s.num_waiting for s in scheds),
            kv_usage=max(s.kv_usage() for s in scheds), radix_hit_tokens=sum(s.hit_tokens for s in scheds),
            num_steps=self.driver.num_steps, num_tbo_steps=self.driver.num_tbo_steps,
            healthy=self.healthy(), step_seconds=list(self.driver.last_step_seconds))

    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ loop thread
    def _apply(self, adds: list[AddRequest], aborts: list[str]) -> None:
        for a in adds:
            if self._error is not None:
                self._out.append(RequestDelta(a.request_id, [], finished=True,
                                              error=RequestError("unhealthy", self._error)))
                continue
            try:
                if a.request_id in self._sent:
                    raise InvalidRequestError("request_id", f"duplicate request id {a.request_id!r}")
                self.driver.add_request(a.request_id, a.prompt_token_ids, a.params)
                self._sent[a.request_id] = 0
            except InvalidRequestError as e:
                self._out.append(RequestDelta(a.request_id, [], finished=True,
                                              error=RequestError("invalid", e.message, e.field)))
        for rid in aborts:
            if self._sent.pop(rid, None) is not None:
                self.driver.abort_request(rid)
                self._out.append(RequestDelta(rid, [], finished=True, finish_reason="abort"))

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_sleep_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _delta(self, req: Req) -> RequestDelta | None:
        sent = self._sent.get(req.rid)
        if sent is None:  # aborted while its step was in flight
            return None
        reason = req.finished_reason
        if req.finished:
            del self._sent[req.rid]
        else:
            self._sent[req.rid] = len(req.output_ids)
        return RequestDelta(
            req.rid, req.output_ids[sent:], req.output_logprobs[sent:], finished=req.finished,
            finish_reason=reason.kind.value if reason else None, matched_stop=reason.matched if reason else None,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens)

    def _flush(self) -> None:
        if self._out:
            batch, self._out = self._out, []
            self.publish(batch)

    def _fail_all(self, message: str) -> None:
        self._error = message
        err = RequestError("unhealthy", message)
        self._out.extend(RequestDelta(rid, [], finished=True, error=err) for rid in self._sent)
        self._sent.clear()

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
                self._take_commands(block=False)  # refuses adds while unhealthy
                self._flush()
                if self.auto_recover:
                    self._recover()
                else:
                    self._stop.wait(self.idle_sleep_s)
                continue
            self._take_commands(block=not self.driver.has_unfinished())
            if self.driver.has_unfinished():
                try:
                    updated = self.driver.step()
                except Exception as e:  # noqa: BLE001 - a rank or the executor failed: fail requests, go unhealthy
                    log.exception("driver step failed")
                    # Clients see the error type only; the details (tracebacks, hosts, actor ids) stay in the log.
                    self._fail_all(f"engine step failed ({type(e).__name__}); the rank group is restarting")
                else:
                    self._out.extend(d for r in updated if (d := self._delta(r)) is not None)
            self._flush()
