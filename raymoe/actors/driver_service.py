"""DriverService: runs the Driver's step loop on its own thread and publishes one batched message per step.

Ownership: the loop thread is the only code that touches the ``Driver`` (schedulers, radix caches, executor).
Callers hand it work with :meth:`DriverService.submit` (thread-safe, many adds and aborts at once) and receive
results through the ``publish`` callback: once per loop iteration, one :class:`OutputBatch` with a row for every
request that got tokens, finished, was refused or failed in that iteration (written by the DP groups'
schedulers, in columns). So the cost of talking to the front end is one message per step, not one per request and
token.

In a server the service lives in the driver's own process (``raymoe.actors.driver_actor.DriverActor``), never in
the HTTP process: a Python loop doing per-token work next to the engine would take its GIL.

Supervision, from the narrowest scope out:

* one request's fault (its row, its stop check, its delta) fails that request only (``RequestError`` kind
  ``"invalid"`` or ``"failed"``);
* a rank fault (``RankFailure``) ends every in-flight request with an ``"unhealthy"`` error, restarts the rank
  group and counts ``rank_restarts``; the front end resumes those requests once the engine is healthy again, from
  the tokens they delivered (``raymoe.client.request_resume``: the client sees a pause, not an error);
* any other exception in a loop iteration fails every in-flight request (``"failed"``), clears the schedulers and
  keeps the ranks;
* if the loop thread dies anyway, a supervisor thread fails the in-flight requests, refuses new ones while it
  waits ``restart_backoff_s`` (the service reports unhealthy), and starts a new loop (``loop_restarts``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from raymoe.actors.driver import Driver
from raymoe.actors.elastic_world import can_grow, grow_ranks, idle_lost_ranks, recover_ranks
from raymoe.actors.hosted_driver import HostedDriver
from raymoe.actors.output_batch import OutputBatch, RequestEnd
from raymoe.actors.records import AddRequest, EngineStats, RequestDelta, RequestError
from raymoe.actors.weight_update import (
    DEFAULT_WEIGHT_VERSION,
    PendingWeightUpdate,
    WeightUpdate,
    WeightUpdateResult,
    apply_weight_update,
)
from raymoe.config.model import ModelConfig
from raymoe.errors import EngineUnhealthyError
from raymoe.scheduler.scheduler import IdleReport
from raymoe.scheduler.spec_steps import SpecCounters

__all__ = ["AddRequest", "DriverService", "EngineStats", "OutputBatch", "RequestDelta", "RequestError"]

log = logging.getLogger(__name__)

IDLE_PROBE_INTERVAL_S = 5.0
"""How often an idle service probes its ranks for one that died or stopped (``idle_lost_ranks``), seconds."""


class _InjectedLoopDeath(BaseException):  # noqa: N818 - a BaseException on purpose: the catch-all lets it pass
    """Raised by the ``"loop_death"`` test hook: kills the loop thread as an escaped error would."""


class DriverService:
    """Owns a Driver, its step loop thread and the supervisor thread that keeps the loop alive.

    After a rank fault every in-flight request ends with an ``"unhealthy"`` error and the service reports
    unhealthy; with ``auto_recover`` the loop then restarts the rank group (``executor.restart()``) and clears
    the scheduler state, after which it is healthy again. Requests submitted while unhealthy are refused.

    Args:
        driver: the driver (already connected to its ranks): a :class:`Driver`, or a :class:`HostedDriver` whose
            groups publish their rows to the front end themselves (``publish`` then gets the driver's own rows).
        publish: called with each non-empty :data:`OutputBatch` (on the loop thread, or the supervisor's while
            the loop is down); it must not block (hand the batch to another thread or event loop).
        idle_sleep_s: how long the loop waits for new work when there is none, seconds.
        auto_recover: restart the rank group after a rank fault.
        supervise_interval_s: how often the supervisor checks the loop thread, seconds.
        restart_backoff_s: how long a dead loop stays down before it is restarted, seconds (doubled, up to 60 s,
            while it keeps dying within a minute); new requests are refused meanwhile.
        stall_timeout_s: a loop iteration running longer than this makes the service unhealthy, seconds
            (default: the driver's ``step_timeout_s`` plus 30 s).
    """

    def __init__(self, driver: Driver | HostedDriver, publish: Callable[[OutputBatch], None],
                 idle_sleep_s: float = 0.005, auto_recover: bool = True, supervise_interval_s: float = 0.2,
                 restart_backoff_s: float = 2.0,
                 stall_timeout_s: float | None = None):
        if supervise_interval_s <= 0 or restart_backoff_s < 0 or idle_sleep_s <= 0:
            raise ValueError("supervise_interval_s and idle_sleep_s must be > 0, restart_backoff_s >= 0")
        self.driver = driver
        self.publish = publish
        self.idle_sleep_s = idle_sleep_s
        self.auto_recover = auto_recover
        self.supervise_interval_s = supervise_interval_s
        self.restart_backoff_s = restart_backoff_s
        step_timeout = getattr(getattr(driver, "config", None), "step_timeout_s", 300.0)
        self.stall_timeout_s = stall_timeout_s if stall_timeout_s is not None else step_timeout + 30.0
        self.rank_restarts = 0
        self.ep_shrinks = self.ep_grows = 0
        self.loop_restarts = 0
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.weight_updates = 0
        self._update: PendingWeightUpdate | None = None  # a weight update waiting for the requests in flight
        driver.record_outputs = True  # the groups write output rows, which this loop publishes
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._out = OutputBatch()  # rows the loop itself writes (refusals while unhealthy, failures)
        self._error: str | None = None  # set while unhealthy (rank fault being recovered, or the loop is down)
        self._idle: IdleReport | None = None  # idle invariant, measured while no request is in flight
        self._injected: str | None = None
        self._iteration_started = time.monotonic()
        self._last_idle_probe = time.monotonic()
        self._last_death = 0.0
        self._backoff = restart_backoff_s
        self._stop = threading.Event()
        self._thread = self._start_loop()
        self._supervisor = threading.Thread(target=self._supervise, name="raymoe-driver-supervisor", daemon=True)
        self._supervisor.start()

    @property
    def failed_requests(self) -> int:
        """Requests that ended with a ``"failed"`` error so far."""
        return self.driver.failed_requests

    @property
    def num_recoveries(self) -> int:
        """Rank-group restarts so far (same as ``rank_restarts``)."""
        return self.rank_restarts

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, adds: Sequence[AddRequest] = (), aborts: Sequence[str] = ()) -> None:
        """Queue new requests and aborts (applied in that order, at the start of the next loop iteration).
        A refused add is answered by a delta with ``error`` set; unknown abort ids are ignored."""
        if adds or aborts:
            self._commands.put((list(adds), list(aborts)))

    def stats(self) -> EngineStats:
        """A snapshot of the counters (read without stopping the loop; counts may be one step apart)."""
        groups = self.driver.group_stats()
        idle = self._idle
        return EngineStats(
            num_running=sum(s.num_running for s in groups), num_waiting=sum(s.num_waiting for s in groups),
            kv_usage=max(s.kv_usage for s in groups), radix_hit_tokens=sum(s.hit_tokens for s in groups),
            num_steps=self.driver.num_steps, num_tbo_steps=self.driver.num_tbo_steps,
            healthy=self.healthy(), step_seconds=list(self.driver.last_step_seconds),
            health_detail=self.health_detail(), rank_restarts=self.rank_restarts, loop_restarts=self.loop_restarts,
            ep_shrinks=self.ep_shrinks, ep_grows=self.ep_grows, dp_size=len(groups),
            steps_shrunk=getattr(self.driver.executor, "steps_shrunk", 0),
            failed_steps=self.driver.num_failed_steps, failed_requests=self.failed_requests,
            kv_leaked_slots=idle.leaked_kv_slots if idle else 0, req_rows_leaked=idle.leaked_req_rows if idle else 0,
            cache_tokens_locked=idle.locked_cache_tokens if idle else 0, idle_checked=idle is not None,
            step_times=self.driver.step_timer.snapshot(),
            expert_load=self.driver.eplb.report() if self.driver.eplb is not None else None,
            routing=self.driver.router.counters, spec=SpecCounters.total(s.spec for s in groups),
            weight_version=self.weight_version, weight_updates=self.weight_updates)

    def update_weights(self, update: WeightUpdate, served: ModelConfig,
                       load_timeout_s: float = 600.0) -> WeightUpdateResult:
        """Serve ``update.model_path``'s weights (``raymoe.actors.weight_update``): from the next loop iteration
        new requests are held; the requests in flight finish (or are aborted, ``abort_all_requests``); then every
        rank loads the folder, the radix caches are flushed and the held requests are admitted. Blocks the caller
        until then. ``served``: the served architecture. ``load_timeout_s``: bound on the ranks' load, seconds.

        Returns:
            the result (a refusal, a timeout or a rolled-back load leaves the weights unchanged).
        Raises:
            TimeoutError: the loop did not answer within the wait, the load and a minute more.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("update", PendingWeightUpdate(update, served, future, load_timeout_s)))
        return future.result(timeout=update.timeout_s + load_timeout_s + 60.0)

    def rebalance_experts(self) -> bool:
        """Ask for an expert rebalance at the next step (``raymoe.eplb.controller``). Returns False when the engine
        does not rebalance (``enable_eplb`` off)."""
        eplb = self.driver.eplb
        if eplb is None or not eplb.enable_eplb:
            return False
        eplb.request_rebalance()
        return True

    def health_detail(self) -> str:
        """Why the service is unhealthy, or ``""``."""
        if self._stop.is_set():
            return "the engine is shut down"
        if self._error is not None:
            return self._error
        if not self._thread.is_alive():
            return "the driver loop is down"
        stalled = time.monotonic() - self._iteration_started
        if stalled > self.stall_timeout_s:
            return f"the driver loop has been in one iteration for {stalled:.0f} s"
        return ""

    def healthy(self) -> bool:
        """Whether the loop is alive and serving (not recovering, not stalled, not shut down)."""
        return self.health_detail() == ""

    def inject_fault(self, kind: str) -> None:
        """Fault injection for tests: ``"loop_death"`` kills the loop thread at its next iteration (past the
        catch-all, as an escaped error would); ``"loop_error"`` makes its next iteration raise ``RuntimeError``
        (handled by the catch-all).

        Raises:
            ValueError: an unknown ``kind``.
        """
        if kind not in ("loop_death", "loop_error"):
            raise ValueError(f"unknown fault {kind!r}")
        self._injected = kind

    def shutdown(self) -> None:
        """Stop the loop and the supervisor (in-flight requests are not answered)."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._supervisor.join(timeout=10)

    # ------------------------------------------------------------------ loop thread
    def _start_loop(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, name="raymoe-driver-loop", daemon=True)
        thread.start()
        return thread

    def _apply(self, adds: list[AddRequest], aborts: list[str]) -> None:
        if self._update is not None:  # held until the weight update is done; an abort of a held one ends it here
            gone, held = set(aborts), self._update.held + list(adds)
            for a in held:
                if a.request_id in gone:
                    self._out.end(a.request_id, RequestEnd(finish_reason="abort"))
            self._update.held = [a for a in held if a.request_id not in gone]
            adds = []
        for a in adds:
            if self._error is not None:
                self._out.end(a.request_id, RequestEnd(error=RequestError("unhealthy", self._error)))
                continue
            try:
                accepted = self.driver.submit(a.request_id, a.prompt_token_ids, a.params, a.output_ids,
                                              export_kv=a.export_kv, kv_received=a.kv_received,
                                              kv_stream=a.kv_stream)
            except ValueError as e:  # already in flight, or no reservation to receive into
                self._out.end(a.request_id, RequestEnd(error=RequestError("invalid", str(e), "request_id")))
                continue
            if accepted:
                self._idle = None
        for rid in aborts:
            self.driver.abort_request(rid)

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_sleep_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd[0] == "call":
                self._run_call(*cmd[1:])
            elif cmd[0] == "update":
                self._begin_update(*cmd[1:])
            else:
                self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def call(self, fn: Callable, timeout_s: float = 30.0):
        """Run ``fn(driver)`` on the loop thread (the schedulers' owner) at its next iteration and return its
        result.

        Raises:
            whatever ``fn`` raised; TimeoutError: the loop did not run it within ``timeout_s``.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future.result(timeout=timeout_s)

    def _run_call(self, fn: Callable, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        self._idle = None  # a call may reserve or free KV: measure the idle invariant again
        try:
            future.set_result(fn(self.driver))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    def _begin_update(self, pending: PendingWeightUpdate) -> None:
        refusal = ("another weight update is in progress" if self._update is not None else
                   f"the engine is recovering ({self._error}); retry once /health is ok" if self._error else None)
        if refusal is not None:
            pending.future.set_result(WeightUpdateResult(False, refusal, self.weight_version))
            return
        update = pending.update
        if update.abort_all_requests or update.retract_requests:
            rids = list(self.driver.group_of)
            err = RequestError("retracted", "the weights are being updated; the request goes on with the new ones")
            for rid in rids:
                self.driver.abort_request(rid, err if update.retract_requests else None)
            if update.retract_requests:
                pending.retracted = len(rids)
            else:
                pending.aborted = len(rids)
        pending.deadline = time.monotonic() + pending.update.timeout_s
        self._update = pending

    def _advance_update(self) -> None:
        """Apply the pending weight update once nothing is in flight (or give up at its deadline); then admit
        the requests it held."""
        pending = self._update
        if self.driver.has_unfinished():
            if time.monotonic() < pending.deadline:
                return
            n = len(self.driver.group_of)
            result = WeightUpdateResult(False, f"{n} request(s) still in flight after {pending.update.timeout_s:g} s; "
                                               "the weights are unchanged (abort_all_requests ends them)",
                                        self.weight_version, param="timeout_s")
        else:
            try:
                result = apply_weight_update(self.driver, pending.served, pending.update, self.weight_version,
                                             pending.load_timeout_s)
            except EngineUnhealthyError as e:  # the ranks hold a mix of two checkpoints: rebuild them
                log.error("weight update failed: %s", e)
                self._error = "a weight update failed and the ranks are being rebuilt"
                result = WeightUpdateResult(False, str(e), self.weight_version)
            except Exception as e:  # noqa: BLE001 - answered (apply_weight_update rolls a failed load back itself)
                log.exception("weight update failed")
                result = WeightUpdateResult(False, f"the weight update failed ({type(e).__name__})",
                                            self.weight_version)
        if result.success:
            self.weight_version = result.weight_version
            self.weight_updates += 1
        self._update = None
        self._idle = None
        pending.future.set_result(dataclasses.replace(result, num_aborted_requests=pending.aborted,
                                                      num_retracted_requests=pending.retracted))
        self._apply(pending.held, [])

    def _flush(self) -> None:
        batch, self._out = self._out, OutputBatch()
        batch.extend(self.driver.take_outputs())
        if len(batch):
            self.publish(batch)

    def _flush_quietly(self) -> None:
        try:
            self._flush()
        except Exception:  # noqa: BLE001 - the front end cannot be reached; its reader fails its requests
            log.exception("publishing an output batch failed; dropped it")
            self._out = OutputBatch()

    def _fail_all(self, err: RequestError) -> None:
        """End every in-flight request with ``err`` (rows for the next flush); the caller resets the driver."""
        self._out.extend(self.driver.end_all(err))

    def _recover(self) -> None:
        try:
            how = recover_ranks(self.driver)
        except Exception as e:  # noqa: BLE001 - stay unhealthy; try again later
            log.exception("restarting the rank group failed")
            # Health says why: a placement timeout names the bundles the cluster lacks (no hosts or ids); any
            # other failure is named by its type only (details in the log).
            why = f"{e}" if isinstance(e, TimeoutError) else type(e).__name__
            self._error = f"restarting the rank group failed ({why}); retrying"
            self._stop.wait(5.0)
            return
        if how == "shrink":
            self.ep_shrinks += 1
        else:
            self.rank_restarts += 1
        self._error = None
        log.warning("rank group %s; engine healthy again", "shrank" if how == "shrink" else "restarted")

    def _grow(self) -> None:
        """Replacement ranks have started (``ElasticWorld.replacements_ready``): fail the in-flight requests as
        ``unhealthy`` (the front end resumes them once healthy) and return to the full layout; a failed grow
        leaves the service unhealthy, and the next iteration rebuilds the group."""
        self._error = "replacement ranks started; the rank group grows back to its full layout"
        self._fail_all(RequestError("unhealthy", self._error))
        self._flush()
        try:
            grow_ranks(self.driver)
        except Exception:  # noqa: BLE001 - rebuilt by _recover on the next iteration
            log.exception("growing the rank group failed")
            self._error = "growing the rank group failed; rebuilding it"
            return
        self.ep_grows += 1
        self._error = None

    def _iterate(self) -> None:
        if self._injected == "loop_error":
            self._injected = None
            raise RuntimeError("injected loop error (fault-injection test hook)")
        if self._error is not None:
            self._take_commands(block=False)  # refuses adds while unhealthy
            self._flush()
            if self.auto_recover:
                self._recover()
            else:
                self._stop.wait(self.idle_sleep_s)
            return
        if self.auto_recover and can_grow(self.driver):
            self._grow()
            return
        self._take_commands(block=not self.driver.has_unfinished())
        if self.driver.has_unfinished():
            try:
                self.driver.step()
            except EngineUnhealthyError as e:  # a rank fault: fail every request, restart the ranks
                log.exception("driver step failed")
                # Clients see the error type only; the details (tracebacks, hosts, actor ids) stay in the log.
                self._error = f"engine step failed ({type(e).__name__}); the rank group is restarting"
                self._fail_all(RequestError("unhealthy", self._error))
        else:
            if self._idle is None:
                self._idle = self.driver.idle_report()
            self._probe_idle_ranks()
        if self._update is not None:
            self._advance_update()
        self._flush()

    def _probe_idle_ranks(self) -> None:
        """While no request is in flight, look for lost ranks every ``IDLE_PROBE_INTERVAL_S`` seconds
        (``idle_lost_ranks``): a rank that died or stopped while idle makes the service unhealthy and the next
        iteration recovers (shrinks or rebuilds) before a request meets it, and ``/health`` tells the truth
        meanwhile."""
        now = time.monotonic()
        if not self.auto_recover or now - self._last_idle_probe < IDLE_PROBE_INTERVAL_S:
            return
        self._last_idle_probe = now
        lost = idle_lost_ranks(self.driver)
        if lost:
            log.warning("ranks %s were lost while the engine was idle", lost)
            self._error = f"{len(lost)} rank(s) lost while idle; the rank group is recovering"

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._iteration_started = time.monotonic()
            if self._injected == "loop_death":
                self._injected = None
                raise _InjectedLoopDeath("injected loop death (fault-injection test hook)")
            try:
                self._iterate()
            except Exception as e:  # noqa: BLE001 - the catch-all: fail in-flight requests, keep serving
                log.exception("driver loop iteration failed")
                self._fail_all(RequestError("failed", f"the engine's driver hit an internal error "
                                                      f"({type(e).__name__}); requests in flight were dropped"))
                self._reset_driver()
                self._flush_quietly()

    def _reset_driver(self) -> None:
        try:
            self.driver.reset()
        except Exception:  # noqa: BLE001 - nothing more to do here; the next step shows whether it works
            log.exception("resetting the driver's schedulers failed")

    # ------------------------------------------------------------------ supervisor thread
    def _supervise(self) -> None:
        while not self._stop.wait(self.supervise_interval_s):
            if self._thread.is_alive():
                continue
            self.loop_restarts += 1
            now = time.monotonic()
            self._backoff = min(60.0, self._backoff * 2) if now - self._last_death < 60.0 else self.restart_backoff_s
            self._last_death = now
            self._error = "the engine's driver loop died; restarting it"
            log.error("%s (in %.1f s; %d in-flight requests ended, to be resumed by the front end)", self._error,
                      self._backoff, len(self.driver.group_of))
            err = RequestError("unhealthy", self._error)
            self._fail_all(err)
            self._reset_driver()
            deadline = time.monotonic() + self._backoff
            while True:  # while the loop is down, refuse new requests (within one interval) and drop aborts
                self._refuse_commands(err)
                self._flush_quietly()
                if time.monotonic() >= deadline or self._stop.wait(self.supervise_interval_s):
                    break
            if self._stop.is_set():
                return
            self._error = None
            self._thread = self._start_loop()
            log.warning("driver loop restarted")

    def _refuse_commands(self, err: RequestError) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "call":
                cmd[2].set_exception(EngineUnhealthyError(err.message))
                continue
            if cmd[0] == "update":
                cmd[1].future.set_result(WeightUpdateResult(False, err.message, self.weight_version))
                continue
            adds, _aborts = cmd
            for a in adds:
                self._out.end(a.request_id, RequestEnd(error=err))
