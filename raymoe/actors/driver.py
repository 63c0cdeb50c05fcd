"""Driver: the step loop's coordinator over every DP-attention group.

Ownership: the driver owns the step and nothing per request. Each DP group's requests, scheduler (waiting queue,
running batch, KV allocators, radix cache), in-flight batches and outputs belong to its
:class:`~raymoe.actors.group_scheduler.GroupScheduler`. Every step the driver asks each group for its plan (mode,
tokens, rows, whether it can split for two-batch overlap), makes the decisions all ranks must agree on once from
those O(dp) records (``raymoe.actors.step_decision``: TBO, the graph bucket, the all-to-all mode and capacity, the
tokens per group; a group without work runs IDLE so its ranks still enter every MoE collective), has every group
apply them to its own batch, hands the batches to an executor that sends each rank its group's batch, and gives
each group its ranks' output.

Written as a plain class: the single-rank engine runs it in-process; the served engine runs it in a driver actor.

Overlap (zero-overhead) scheduling, after SGLang's overlap event loop: each :meth:`Driver.step` forms step N+1 and
sends it to the ranks *before* it waits for step N and applies its tokens, so the groups' scheduling, batch
building and output handling run while the ranks compute. Step N+1's decode rows carry placeholders for the tokens
step N samples (``raymoe.scheduler.req``), which the ranks resolve on the device (``raymoe.runner.future_tokens``).
A request that step N finishes may have a row in step N+1; that row's token is dropped, so stop conditions and
aborts take effect at the same token as without overlap. ``SchedulerConfig.disable_overlap_schedule`` turns it off.
With speculative decoding the driver waits for the running step before it forms the next whenever a group may
verify drafts or run the draft model's passes next (``raymoe.scheduler.spec_steps.SpecSteps.wants_fresh_tokens``,
which is also True right after a group formed such a step): a verify or draft step is formed from the result of the
step before it, and its own result is applied before the next is formed (positions and drafts follow from it).
Plain steps between them overlap as above: with the adaptive draft policy a batch where drafting does not pay keeps
overlap scheduling's gain.

Fault scope: a request whose own row cannot be built or post-processed fails alone (the schedulers see to it).
A step that a rank could not compute (:class:`~raymoe.actors.executor.RankStepError`) fails the requests of that
step and keeps the ranks when they all still answer; a second failed step in a row, or a rank fault
(:class:`~raymoe.actors.executor.RankFailure`), is raised to the caller, which restarts the rank group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from raymoe.actors.coordinator import StepCoordinator
from raymoe.actors.dp_router import DpRouter
from raymoe.actors.group_messages import GroupStats
from raymoe.actors.group_scheduler import GroupScheduler
from raymoe.actors.output_batch import OutputBatch
from raymoe.actors.records import RequestError
from raymoe.actors.step_errors import RankFailure, RankStepError
from raymoe.config import EngineConfig
from raymoe.scheduler.req import Req, RequestFault
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.scheduler import IdleReport, Scheduler
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.kv_stream import KVStreamTarget
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch


class StepExecutor(Protocol):
    """Runs one global step: one ``ModelWorkerBatch`` per DP group -> one ``StepOutput`` per DP group.

    ``launch`` sends a step without waiting and ``collect`` waits for it; the ranks run launched steps in launch
    order and steps are collected in that order. ``execute`` is ``collect(launch(batches))``.
    """

    def execute(self, batches: list[ModelWorkerBatch]) -> list[StepOutput]: ...

    def launch(self, batches: list[ModelWorkerBatch]) -> Any: ...

    def collect(self, handle: Any) -> list[StepOutput]: ...

    def ranks_alive(self) -> bool: ...


@dataclass
class _LaunchedStep:
    """A step sent to the ranks: the executor's handle, the step's ``step_timing.step_mode`` label and when it was
    sent (``StepTimer.clock`` seconds), and the PD requests whose KV it streams. Each group keeps its own batch of
    the step."""

    handle: Any
    mode: str
    launched_at: float
    streams: frozenset[str] = frozenset()  # tags of the requests whose KV the step writes layer by layer


class Driver(StepCoordinator):
    """Schedules requests over ``dp_size`` groups and runs steps through ``executor``.

    Args:
        config: engine configuration (cache and scheduler limits apply per DP group).
        executor: fans batches out to ranks.
        eos_token_ids: the model's end-of-sequence ids.
        detokenize: token ids -> text (stop strings).
        dp_size: number of DP-attention groups.
        graph_capture_sizes: decode-graph buckets the ranks captured (empty: always eager).
        vocab_size: token ids must lie in ``[0, vocab_size)`` (None: unchecked); the schedulers check it on
            admission (``raymoe.scheduler.request_rules``) so that no front end can send a rank an id its
            embedding cannot look up.
        a2a_mode: the MoE all-to-all mode the ranks were built with (``RunnerConfig.moe_comm.a2a_mode``; None: the
            config's ``moe_comm.a2a_mode``); resolved per step by ``raymoe.comm.a2a_plan``.
        eplb: the expert-load window and rebalance planner (``raymoe.eplb.controller.EplbController``), or None.
    """

    def __init__(self, config: EngineConfig, executor: StepExecutor, eos_token_ids: Sequence[int],
                 detokenize: Callable[[Sequence[int]], str] | None, dp_size: int = 1,
                 graph_capture_sizes: Sequence[int] = (), vocab_size: int | None = None, a2a_mode: str | None = None,
                 eplb=None):
        super().__init__(config, executor, graph_capture_sizes, vocab_size, a2a_mode, eplb)
        self._group_args = (config, tuple(eos_token_ids), detokenize, vocab_size)
        self.groups = [GroupScheduler(d, *self._group_args) for d in range(dp_size)]
        self.router = DpRouter(dp_size, config.scheduler.load_balance_method,
                               config.scheduler.prefix_routing_max_load_ratio)
        self._launched: _LaunchedStep | None = None  # overlap scheduling: the step the ranks are computing
        self.num_overlapped_steps = 0  # steps sent while the one before was still running
        self._reserved_in: dict[str, int] = {}  # PD decode side: request id -> group holding its KV reservation

    @property
    def schedulers(self) -> list[Scheduler]:
        """Each group's scheduler (for stats, tests and audits)."""
        return [g.scheduler for g in self.groups]

    @property
    def failed_requests(self) -> int:
        """Requests that ended with a ``"failed"`` error so far (every group, before and after resets)."""
        return self._failed_before_reset + sum(g.failed_requests for g in self.groups)

    @property
    def num_idle_group_steps(self) -> int:
        """Group-steps run IDLE so far (a group without work while another computed)."""
        return sum(g.num_idle_steps for g in self.groups)

    def _route(self, input_ids: Sequence[int]) -> int:
        """Pick the DP group (``raymoe.actors.dp_router``: the longest cached prefix within the load bound, else the
        least loaded group; load = running + waiting requests)."""
        if len(self.groups) == 1:
            return 0
        self._index_prefixes()
        loads = [s.num_running + s.num_waiting for s in self.schedulers]
        return self.router.route(input_ids, loads).group

    def _index_prefixes(self) -> None:
        """Fold what each group's radix tree stored and evicted into the router's index."""
        for g in self.groups:
            self.router.apply(g.index, g.take_prefix_delta())

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> Req:
        """Queue a request on a DP group.

        Raises:
            InvalidRequestError: the scheduler refused it (``Scheduler.add_request``: the prompt is empty, too long
                or outside the vocabulary, too many log-probabilities, the queue is full ...; names the field).
                ``params`` were checked when they were built (``SamplingParams``).
        """
        if rid in self.group_of:
            raise ValueError(f"duplicate request id {rid!r}")
        group = self._route(input_ids)
        req = self.groups[group].add(rid, input_ids, params, report=False)
        self.group_of[rid] = group
        return req

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams, output_ids: Sequence[int] = (),
               export_kv: bool = False, kv_received: bool = False, kv_stream: KVStreamTarget | None = None) -> bool:
        """Queue a request for the serving loop (``output_ids``: a resumed request's tokens so far;
        ``export_kv``, ``kv_received``, ``kv_stream``: prefill/decode disaggregation; see ``AddRequest``): a
        refusal ends it in its group's output rows instead of raising. Returns whether it was accepted."""
        if rid in self.group_of:
            raise ValueError(f"duplicate request id {rid!r}")
        if kv_received:
            group = self._reserved_in.pop(rid, None)
            if group is None:
                raise ValueError(f"request {rid!r} holds no KV reservation")
            self.groups[group].scheduler.state.cache_received(rid, input_ids)
        else:
            group = self._route(input_ids)
        if self.groups[group].add(rid, input_ids, params, output_ids=output_ids, export_kv=export_kv,
                                  kv_stream=kv_stream) is None:
            return False
        self.group_of[rid] = group
        return True

    # ------------------------------------------------------------- prefill/decode disaggregation (pd_client)
    def reserve_kv(self, rid: str, num_tokens: int) -> tuple[int, list[int]] | None:
        """Decode side: reserve ``num_tokens`` KV slots for ``rid``'s prompt in the least loaded group that can
        hold them; returns (group, slots), or None when no group can now."""
        loads = [s.num_running + s.num_waiting + len(s.state.kv_reservations) for s in self.schedulers]
        for group in sorted(range(len(loads)), key=lambda g: (loads[g], g)):
            slots = self.groups[group].scheduler.state.reserve_kv(rid, num_tokens)
            if slots is not None:
                self._reserved_in[rid] = group
                return group, slots
        return None

    def cancel_reservation(self, rid: str) -> bool:
        """Decode side: free ``rid``'s reservation (its KV will not come). Returns whether one was held."""
        group = self._reserved_in.pop(rid, None)
        return group is not None and self.groups[group].scheduler.state.cancel_reservation(rid)

    def kv_export(self, rid: str) -> tuple[int, list[int], bool] | None:
        """Prefill side: (group, slots, streamed) of ``rid``'s prompt KV held for the decode engine, or None;
        ``streamed``: every prompt position went out in a streamed step (``KVExport.streamed``)."""
        for g in self.groups:
            held = g.scheduler.state.kv_exports.get(rid)
            if held is not None:
                return g.index, list(held.slots), held.streamed
        return None

    def kv_stream_settled(self, rid: str) -> bool:
        """Prefill side: whether no step can write ``rid``'s streamed KV any more (it has left its group and is
        not in the step the ranks are computing), so the decode side may free the reservation it wrote into."""
        return rid not in self.group_of and (self._launched is None or rid not in self._launched.streams)

    def release_export(self, rid: str) -> bool:
        """Prefill side: unlock ``rid``'s exported prompt KV. Returns whether it was held."""
        return any(g.scheduler.state.release_export(rid) for g in self.groups)

    def abort_request(self, rid: str, error: RequestError | None = None) -> bool:
        """Abort ``rid`` wherever it is; its KV is freed (its group ends its output row with ``"abort"``, or with
        ``error``). Returns False for an unknown or finished id."""
        group = self.group_of.pop(rid, None)
        return group is not None and self.groups[group].abort(rid, error)

    def reset(self, dp_size: int | None = None) -> list[Req]:
        """Forget every request and KV mapping (after the rank group was restarted, shrunk or grown: ``dp_size``
        is then its new number of DP groups; None: unchanged); returns the dropped requests (the caller fails
        them)."""
        dropped = [r for g in self.groups for r in g.reqs.values()]
        self._failed_before_reset += sum(g.failed_requests for g in self.groups)
        dp_size = dp_size or len(self.groups)
        self.groups = [GroupScheduler(d, *self._group_args) for d in range(dp_size)]
        if dp_size != self.router.dp_size:
            sched = self.config.scheduler
            self.router = DpRouter(dp_size, sched.load_balance_method, sched.prefix_routing_max_load_ratio)
        self.router.clear()
        self._reserved_in.clear()
        self.group_of.clear()
        self._step_errors_in_a_row = 0
        self._launched = None
        if self.eplb is not None:
            self.eplb.abort()
        return dropped

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished or a step is still in flight (``step`` must be called again)."""
        return self._launched is not None or any(g.has_work() for g in self.groups)

    def step(self) -> list[Req]:
        """Run one global step. Returns requests that got a token or finished (finished ones are forgotten by the
        driver afterwards).

        With overlap scheduling it sends the next step to the ranks first and then applies the tokens of the step
        sent by the previous call, so the returned requests are those of that previous step.

        Raises:
            RankFailure: the ranks must be restarted (every in-flight request is left to the caller to fail).
        """
        updated: list[Req] = []
        if self._launched is not None and self._wants_fresh_tokens():  # the next step may verify or draft
            previous, self._launched = self._launched, None
            updated.extend(self._finish(previous))
        launched = self._launch_next(updated)
        if self.overlap_schedule:  # finish the previous step; this one stays in flight until the next call
            self.num_overlapped_steps += launched is not None and self._launched is not None
            launched, self._launched = self._launched, launched
        if launched is not None:
            updated.extend(self._finish(launched))
        self._index_prefixes()
        return self._forget_finished(updated)

    def _launch_next(self, early: list[Req]) -> _LaunchedStep | None:
        """Ask every group for its plan, decide once for every rank and send the step; ``None`` when no group has
        work. Requests the groups finished while planning (out of KV) are appended to ``early``."""
        plans = []
        for g in self.groups:
            plan, finished = g.plan()
            plans.append(plan)
            if self.record_outputs:
                g.record(finished)
            early.extend(finished)
        if all(p.forward_mode == ForwardMode.IDLE for p in plans):
            return None
        decision, mode = self._decide(plans)
        batches = [g.batch_for(decision) for g in self.groups]
        launched_at = self.step_timer.clock()
        streams = frozenset(c.tag for b in batches for c in b.kv_streams)
        return _LaunchedStep(self.executor.launch(batches), mode, launched_at, streams)

    def _wants_fresh_tokens(self) -> bool:
        """Whether some group's next step may verify drafts or run the draft model's passes
        (``SpecSteps.wants_fresh_tokens``), so it must see the running step's tokens. It is True right after a group
        formed a verify or draft step, so such a step is always finished before the next one is formed."""
        return any(g.scheduler.spec is not None and g.scheduler.spec.wants_fresh_tokens() for g in self.groups)

    def _finish(self, launched: _LaunchedStep) -> list[Req]:
        """Wait for a launched step and give each group its ranks' output; a step the ranks raised in fails its
        requests."""
        try:
            outputs = self.executor.collect(launched.handle)
        except RankStepError as e:
            return self._fail_step(e)
        self._collected(launched.mode, launched.launched_at, [o.forward_seconds for o in outputs],
                        [o.expert_load for o in outputs])
        updated: list[Req] = []
        for g, out in zip(self.groups, outputs, strict=True):
            done = g.finish(out)
            if self.record_outputs:
                g.record(done)
            updated.extend(done)
        return updated

    def _fail_step(self, error: RankStepError) -> list[Req]:
        """A rank raised in the step: fail the step's requests (they free their KV) and keep the ranks if they all
        answer and this is not the second such step in a row.

        Raises:
            RankFailure: the ranks must be restarted (the step's requests are failed already).
        """
        restart = self._step_failed()
        fault = RequestFault("failed", f"the engine could not compute this request's step ({error}); the "
                                       "other requests go on")
        alive = self.executor.ranks_alive()
        if alive and self._launched is not None:  # the next step was sent already: wait for it, drop its tokens
            following, self._launched = self._launched, None
            try:
                self.executor.collect(following.handle)
            except RankStepError:
                pass
        failed: list[Req] = []
        for g in self.groups:
            group_failed = g.fail_inflight(fault)
            if self.record_outputs:
                g.record(group_failed)
            failed.extend(group_failed)
        if restart or not alive:
            self._forget_finished(failed)
            raise RankFailure(f"{self._step_errors_in_a_row} failed step(s) in a row; restarting the ranks") \
                from error
        return failed

    def flush_cache(self) -> None:
        """Drop every DP group's radix cache (after a weight update). Raises RuntimeError: a group is not idle
        (``Scheduler.flush_cache``)."""
        for g in self.groups:
            g.scheduler.flush_cache()

    def idle_report(self) -> IdleReport | None:
        """The idle invariant summed over DP groups when no group holds a request (``None`` otherwise)."""
        reports = [s.idle_report() for s in self.schedulers]
        if any(r is None for r in reports):
            return None
        return IdleReport(leaked_kv_slots=sum(r.leaked_kv_slots for r in reports),
                          leaked_req_rows=sum(r.leaked_req_rows for r in reports),
                          locked_cache_tokens=sum(r.locked_cache_tokens for r in reports))

    def group_stats(self) -> list[GroupStats]:
        """Each group's counters (routing, ``/metrics``)."""
        return [g.stats() for g in self.groups]

    def end_all(self, error: RequestError) -> OutputBatch:
        """End every unfinished request with ``error``: returns their rows (the caller then resets the driver)."""
        out = OutputBatch()
        for g in self.groups:
            g.end_all(error)
            out.extend(g.take_outputs())
        return out

    def take_outputs(self) -> OutputBatch:
        """Every group's output rows since the last call, group after group (``record_outputs``)."""
        out = OutputBatch()
        for g in self.groups:
            out.extend(g.take_outputs())
        return out

    def _forget_finished(self, updated: list[Req]) -> list[Req]:
        for req in updated:
            if req.finished_reason is not None:
                self.group_of.pop(req.rid, None)
        return updated
