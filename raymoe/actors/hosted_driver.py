"""HostedDriver: the step loop's coordinator when each DP group's scheduler runs in a process of its own.

Ownership: the hosted driver owns the step and the request -> group table, nothing else per request. Each group's
requests, scheduler, radix cache, KV allocators, batches, its ranks' step channel and its output rows belong to its
group server (``raymoe.actors.group_server``, in a ``raymoe.actors.group_actor.GroupSchedulerActor`` beside the
group's ranks). Per step the driver sends every group one command and reads one reply
(``raymoe.actors.group_messages``): the step's shared decisions out, the group's next plan and counters back. So
its work per step is O(dp) records of a few hundred bytes, whatever the number of requests, and the groups'
per-request work (forming batches, applying tokens, stop checks, output rows) runs in parallel, one process each.

The step, with overlap scheduling (as ``raymoe.actors.driver.Driver``): every group formed its next batch at the
end of the previous exchange and answered its plan; the driver decides from those plans
(``raymoe.actors.step_decision``: TBO, graph bucket, all-to-all mode, tokens per group; IDLE for a group without
work) and sends the decision with "finish the oldest step in flight"; each group sends its batch to its ranks, then
waits for its ranks' output of the previous step, applies it, publishes its rows to the front end, takes the new
requests and aborts routed to it, forms the next batch and replies. A request routed while a group has work joins
at the next exchange; while every group is idle, the driver runs a plan-only exchange first (a group never forms a
second batch while one it formed waits to be sent).

Faults (as the in-process driver): a step a rank raised in (a reply's ``step_error``) makes every group fail its
in-flight requests after its ranks answered (``"fail_inflight"``), keeping the ranks unless it is the second in a
row or a rank is silent; a rank fault, a group that went away or went silent (``rank_failure`` or a broken link)
raises :class:`~raymoe.actors.step_errors.RankFailure` and the caller restarts the ranks and the group processes;
an error in a group's own code raises ``RuntimeError`` and the caller's catch-all resets the groups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from raymoe.actors.coordinator import StepCoordinator
from raymoe.actors.dp_router import DpRouter
from raymoe.actors.group_link import encode, gather_replies
from raymoe.actors.group_messages import GroupCommand, GroupControl, GroupReply, GroupStats
from raymoe.actors.output_batch import OutputBatch, RequestEnd
from raymoe.actors.records import AddRequest, RequestError
from raymoe.actors.step_errors import RankFailure
from raymoe.config import EngineConfig
from raymoe.scheduler.accounting import IdleReport
from raymoe.scheduler.req import RequestFault
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_plan import GroupPlan, StepDecision

# Bound on a group's reply beyond the step bound, seconds (its own work: applying tokens, forming a batch).
REPLY_MARGIN_S = 30.0
# Bound on a group's reply to "end_all" and "reset" after a fault, seconds (a silent group is rebuilt anyway).
FAULT_REPLY_S = 10.0


class HostedDriver(StepCoordinator):
    """Coordinates ``dp_size`` group servers over ``executor.links`` (module docstring).

    Args:
        config: engine configuration. executor: the ranks and the group processes (``links``: one
            :class:`~raymoe.actors.group_link.GroupLink` per group, in DP order; ``ranks_alive()``, ``restart()``).
        dp_size: number of DP-attention groups. graph_capture_sizes, vocab_size, a2a_mode: as ``StepCoordinator``.
    """

    def __init__(self, config: EngineConfig, executor, dp_size: int, graph_capture_sizes: Sequence[int] = (),
                 vocab_size: int | None = None, a2a_mode: str | None = None, eplb=None):
        super().__init__(config, executor, graph_capture_sizes, vocab_size, a2a_mode, eplb)
        # the group processes plan before they see a step's result: speculative steps run one at a time here
        self.overlap_schedule = self.overlap_schedule and not config.speculative.enabled
        self.dp_size = dp_size
        self.router = DpRouter(dp_size, config.scheduler.load_balance_method,
                               config.scheduler.prefix_routing_max_load_ratio)
        self.reply_timeout_s = config.step_timeout_s + REPLY_MARGIN_S
        self._clear()

    def _clear(self) -> None:
        n = self.dp_size
        self._plans = [GroupPlan.idle()] * n
        self._stats = [GroupStats()] * n
        self._adds: list[list[AddRequest]] = [[] for _ in range(n)]
        self._aborts: list[list[str]] = [[] for _ in range(n)]
        self._abort_errors: list[RequestError | None] = [None] * n  # how the group's next aborts end
        self._inflight: deque[tuple[str, float]] = deque()  # launched steps: (step mode label, launch time)
        self._out = OutputBatch()  # rows the driver itself writes (aborts before a group saw the request)
        self.group_of.clear()
        self._step_errors_in_a_row = 0
        self.router.clear()

    # ------------------------------------------------------------------------------------------------ requests
    @property
    def failed_requests(self) -> int:
        """Requests that ended with a ``"failed"`` error so far (every group, before and after resets)."""
        return self._failed_before_reset + sum(s.failed_requests for s in self._stats)

    @property
    def num_idle_group_steps(self) -> int:
        """Group-steps run IDLE so far."""
        return sum(s.num_idle_steps for s in self._stats)

    def group_stats(self) -> list[GroupStats]:
        """Each group's counters as of its last reply."""
        return list(self._stats)

    def _route(self, input_ids: Sequence[int]) -> int:
        """Pick the DP group (``raymoe.actors.dp_router``: the longest cached prefix within the load bound, else the
        least loaded group; load = running + waiting + routed since the group's last reply). The index of cached
        prefixes is as of the groups' last replies."""
        if self.dp_size == 1:
            return 0
        loads = [s.num_running + s.num_waiting + len(a) for s, a in zip(self._stats, self._adds, strict=True)]
        return self.router.route(input_ids, loads).group

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams, output_ids: Sequence[int] = (),
               export_kv: bool = False, kv_received: bool = False, kv_stream=None) -> bool:
        """Route a request to a group (sent with the next exchange; a refusal ends it in the group's rows);
        ``output_ids``: a resumed request's tokens so far (``AddRequest``). Returns True (queued).

        Raises:
            ValueError: ``rid`` is in flight already, or ``export_kv`` / ``kv_received`` (prefill/decode
                disaggregation reserves and receives KV in the driver's own groups: ``group_schedulers="driver"``).
        """
        if export_kv or kv_received or kv_stream is not None:
            raise ValueError("prefill/decode disaggregation needs group_schedulers=driver")
        if rid in self.group_of:
            raise ValueError(f"duplicate request id {rid!r}")
        group = self._route(input_ids)
        self._adds[group].append(AddRequest(rid, list(input_ids), params, tuple(output_ids)))
        self.group_of[rid] = group
        return True

    def abort_request(self, rid: str, error: RequestError | None = None) -> bool:
        """Abort ``rid`` at its group's next exchange (its KV is freed there, its row ends ``"abort"``, or with
        ``error``: then every abort of that exchange does, see ``GroupCommand.abort_error``); one its group has not
        seen yet ends here. Returns False for an unknown or finished id."""
        group = self.group_of.get(rid)
        if group is None:
            return False
        adds = self._adds[group]
        for i, a in enumerate(adds):
            if a.request_id == rid:
                del adds[i]
                del self.group_of[rid]
                self._out.end(rid, RequestEnd(error=error) if error is not None else RequestEnd(finish_reason="abort"))
                return True
        self._aborts[group].append(rid)
        if error is not None:
            self._abort_errors[group] = error
        return True

    def take_outputs(self) -> OutputBatch:
        """The rows the driver wrote itself since the last call (the groups publish theirs directly)."""
        out, self._out = self._out, OutputBatch()
        return out

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished, a command is pending or a step is in flight."""
        return bool(self._inflight) or self._pending() or any(s.has_work for s in self._stats)

    def _pending(self) -> bool:
        return any(self._adds) or any(self._aborts)

    # --------------------------------------------------------------------------------------------------- steps
    def step(self) -> list:
        """Run one global step (module docstring). Returns ``[]``: requests' progress reaches the front end from
        the groups.

        Raises:
            RankFailure: the ranks and group processes must be restarted. RuntimeError: a group's own code failed.
        """
        idle = all(p.forward_mode == ForwardMode.IDLE for p in self._plans)  # then no group holds a formed batch
        if idle and not self._inflight and self._pending():
            self._exchange(None, finish=False)  # apply the routed requests and aborts, and plan with them
            idle = all(p.forward_mode == ForwardMode.IDLE for p in self._plans)
        decision = mode = None
        if not idle:
            decision, mode = self._decide(self._plans)
        finish = bool(self._inflight) or (decision is not None and not self.overlap_schedule)
        if decision is not None:
            self._inflight.append((mode, self.step_timer.clock()))
        elif not finish:
            if any(s.has_work for s in self._stats):
                self._exchange(None, finish=False)  # work that could not be planned: plan again next call
            return []
        replies = self._exchange(decision, finish)
        if finish:
            self._finished(replies)
        return []

    def _exchange(self, decision: StepDecision | None, finish: bool) -> list[GroupReply]:
        links = self.executor.links
        shared = None
        for g, link in enumerate(links):
            if self._adds[g] or self._aborts[g]:
                link.send(encode(GroupCommand(decision, finish, tuple(self._adds[g]), tuple(self._aborts[g]),
                                              self._abort_errors[g])))
                self._adds[g], self._aborts[g], self._abort_errors[g] = [], [], None
            else:
                shared = shared or encode(GroupCommand(decision, finish))
                link.send(shared)
        try:  # a group's rank failure, at a launch too (its ranks died while the engine idled), is a rank fault
            replies = gather_replies(links, self.reply_timeout_s)
        except RankFailure:
            self._inflight.clear()
            raise
        return self._absorb(replies)

    def _absorb(self, replies: list[GroupReply]) -> list[GroupReply]:
        for g, r in enumerate(replies):
            self._plans[g] = r.plan if r.plan is not None else GroupPlan.idle()
            self._stats[g] = r.stats
            self.router.apply(g, r.prefix_delta)
            for rid in r.ended:
                if self.group_of.get(rid) == g:
                    del self.group_of[rid]
        errors = [r.internal_error for r in replies if r.internal_error]
        if errors:
            raise RuntimeError(f"a DP group's scheduler failed ({errors[0]})")
        return replies

    def _finished(self, replies: list[GroupReply]) -> None:
        mode, launched_at = self._inflight.popleft()  # rank failures raised in _exchange (gather_replies)
        error = next((r.step_error for r in replies if r.step_error), None)
        if error is not None:
            self._fail_step(error, all(r.ranks_alive for r in replies))
            return
        self._collected(mode, launched_at, [r.forward_seconds or 0.0 for r in replies],
                        [r.expert_load for r in replies])

    def _fail_step(self, error: str, alive: bool) -> None:
        restart = self._step_failed()
        fault = RequestFault("failed", f"the engine could not compute this request's step ({error}); the "
                                       "other requests go on")
        self._inflight.clear()
        replies = self._control(GroupControl("fail_inflight", fault=fault))
        if restart or not alive or not all(r.ranks_alive for r in replies):
            raise RankFailure(f"{self._step_errors_in_a_row} failed step(s) in a row; restarting the ranks")

    def _control(self, msg: GroupControl) -> list[GroupReply]:
        payload = encode(msg)
        links = self.executor.links
        for link in links:
            link.send(payload)
        return self._absorb([link.recv(self.reply_timeout_s) for link in links])

    # ---------------------------------------------------------------------------------------- after a fault
    def end_all(self, error: RequestError) -> OutputBatch:
        """End every unfinished request with ``error``: each reachable group ends its own (its rows go to the front
        end); the returned rows end the requests of groups that cannot be reached and of unsent adds."""
        out, self._out = self._out, OutputBatch()
        payload = encode(GroupControl("end_all", error=error))
        for g, link in enumerate(self.executor.links):
            unsent = [a.request_id for a in self._adds[g]]
            self._adds[g], self._aborts[g], self._abort_errors[g] = [], [], None
            try:
                link.send(payload)
                reply = link.recv(FAULT_REPLY_S)
            except RankFailure:
                unsent = [rid for rid, group in self.group_of.items() if group == g]
            else:
                self._stats[g] = reply.stats
            for rid in unsent:
                out.end(rid, RequestEnd(error=error))
                self._failed_before_reset += error.kind == "failed"
        return out

    def reset(self) -> list:
        """Forget every request (each reachable group starts a fresh scheduler); returns ``[]`` (the groups ended
        their requests in ``end_all``)."""
        self._failed_before_reset += sum(s.failed_requests for s in self._stats)
        payload = encode(GroupControl("reset"))
        for link in self.executor.links:
            try:
                link.send(payload)
                link.recv(FAULT_REPLY_S)
            except RankFailure:
                pass  # a group process that is gone is rebuilt by the executor's restart
        self._clear()
        if self.eplb is not None:
            self.eplb.abort()
        return []

    def flush_cache(self) -> None:
        """Drop every DP group's radix cache, each in its process (``GroupControl("flush_cache")``).

        Raises:
            RuntimeError: a group could not flush (``Scheduler.flush_cache``'s message: it was not idle).
        """
        self._control(GroupControl("flush_cache"))

    def idle_report(self) -> IdleReport | None:
        """The idle invariant summed over the groups when none holds a request (``None`` otherwise)."""
        if self.has_unfinished():
            return None
        reports = [r.idle for r in self._control(GroupControl("idle_report"))]
        if any(r is None for r in reports):
            return None
        return IdleReport(leaked_kv_slots=sum(r.leaked_kv_slots for r in reports),
                          leaked_req_rows=sum(r.leaked_req_rows for r in reports),
                          locked_cache_tokens=sum(r.locked_cache_tokens for r in reports))
