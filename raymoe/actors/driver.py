"""Driver: global scheduling over every DP-attention group.

Ownership: the driver owns the requests, and per DP group a ``Scheduler`` (waiting queue, running batch, slot
allocators, radix cache). Every step it asks each group's scheduler for a batch, gives groups without work an
IDLE batch (so their ranks still enter every MoE collective), makes the decisions all ranks must agree on, hands
the batches to an executor that fans them out to the ranks, and feeds the sampled tokens back to the schedulers.

Written as a plain class: the single-rank engine runs it in-process; the cluster engine wraps it in a Ray actor.

Overlap (zero-overhead) scheduling, after SGLang's overlap event loop: each :meth:`Driver.step` forms step N+1 and
sends it to the ranks *before* it waits for step N and applies its tokens, so the driver's scheduling, batch
building and output handling run while the ranks compute. Step N+1's decode rows carry placeholders for the tokens
step N samples (``raymoe.scheduler.req``), which the ranks resolve on the device (``raymoe.runner.future_tokens``).
A request that step N finishes may have a row in step N+1; that row's token is dropped, so stop conditions and
aborts take effect at the same token as without overlap. ``SchedulerConfig.disable_overlap_schedule`` turns it off.

Fault scope: a request whose own row cannot be built or post-processed fails alone (the schedulers see to it).
A step that a rank could not compute (:class:`~raymoe.actors.executor.RankStepError`) fails the requests of that
step and keeps the ranks when they all still answer; a second failed step in a row, or a rank fault
(:class:`~raymoe.actors.executor.RankFailure`), is raised to the caller, which restarts the rank group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from raymoe.actors.executor import RankFailure, RankStepError
from raymoe.actors.step_timing import StepTimer, step_mode
from raymoe.comm.a2a_plan import apply_dispatch_plan
from raymoe.config import EngineConfig
from raymoe.overlap.decision import apply_tbo_decision
from raymoe.runner.graph_buckets import apply_graph_plan
from raymoe.scheduler.req import Req, RequestFault
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.scheduler.scheduler import IdleReport, Scheduler
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
    """A step sent to the ranks: each DP group's batch (None: the group ran IDLE), the executor's handle, the
    step's ``step_timing.step_mode`` label and when it was sent (``StepTimer.clock`` seconds)."""

    sched_batches: list[ScheduleBatch | None]
    handle: Any
    mode: str
    launched_at: float

# Failed steps in a row (RankStepError) after which the ranks are restarted even though they answer.
MAX_CONSECUTIVE_STEP_ERRORS = 2


class Driver:
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
    """

    def __init__(self, config: EngineConfig, executor: StepExecutor, eos_token_ids: Sequence[int],
                 detokenize: Callable[[Sequence[int]], str] | None, dp_size: int = 1,
                 graph_capture_sizes: Sequence[int] = (), vocab_size: int | None = None, a2a_mode: str | None = None):
        self.config = config
        self.a2a_mode = a2a_mode or config.moe_comm.a2a_mode
        self.executor = executor
        self.graph_capture_sizes = tuple(graph_capture_sizes)
        self.vocab_size = vocab_size
        self.schedulers = [Scheduler(config.scheduler, config.cache, eos_token_ids=eos_token_ids,
                                     detokenize=detokenize, vocab_size=vocab_size) for _ in range(dp_size)]
        self.reqs: dict[str, Req] = {}
        self.group_of: dict[str, int] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_idle_group_steps = 0
        self.num_tbo_steps = 0
        self.num_graph_steps = 0
        self.num_low_latency_steps = 0  # steps whose MoE dispatch ran in low-latency mode
        self.num_mixed_steps = 0  # steps in which some group ran a MIXED batch (prefill chunks + decodes)
        self.num_failed_steps = 0  # steps a rank raised in (their requests failed; ranks kept)
        self._step_errors_in_a_row = 0
        self.last_step_seconds: list[float] = []  # forward+sample seconds of each DP group's tp-rank 0
        self.step_timer = StepTimer()  # period and forward time of collected steps, by mode (for /metrics)
        self.overlap_schedule = not config.scheduler.disable_overlap_schedule
        self._launched: _LaunchedStep | None = None  # overlap scheduling: the step the ranks are computing

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}"

    def _route(self, input_ids: Sequence[int]) -> int:
        """Pick the DP group: the least loaded one (running + waiting requests), ties to the lowest index."""
        loads = [s.num_running + s.num_waiting for s in self.schedulers]
        return loads.index(min(loads))

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> Req:
        """Queue a request on a DP group.

        Raises:
            InvalidRequestError: the scheduler refused it (``Scheduler.add_request``: the prompt is empty, too long
                or outside the vocabulary, too many log-probabilities, the queue is full ...; names the field).
                ``params`` were checked when they were built (``SamplingParams``).
        """
        if rid in self.reqs:
            raise ValueError(f"duplicate request id {rid!r}")
        group = self._route(input_ids)
        req = Req(rid, list(input_ids), params)
        self.schedulers[group].add_request(req)
        self.reqs[rid] = req
        self.group_of[rid] = group
        return req

    def abort_request(self, rid: str) -> None:
        """Abort ``rid`` wherever it is; its KV is freed. Unknown ids are ignored."""
        group = self.group_of.pop(rid, None)
        if group is not None:
            self.schedulers[group].abort_request(rid)
        self.reqs.pop(rid, None)

    def reset(self) -> list[Req]:
        """Forget every request and KV mapping (after the rank group was restarted); returns the dropped
        requests (the caller fails them)."""
        dropped = list(self.reqs.values())
        self.schedulers = [Scheduler(self.config.scheduler, self.config.cache, eos_token_ids=s.eos_token_ids,
                                     detokenize=s.detokenize, vocab_size=self.vocab_size) for s in self.schedulers]
        self.reqs.clear()
        self.group_of.clear()
        self._step_errors_in_a_row = 0
        self._launched = None
        return dropped

    def has_unfinished(self) -> bool:
        """Whether a request is unfinished or a step is still in flight (``step`` must be called again)."""
        return self._launched is not None or any(s.has_unfinished() for s in self.schedulers)

    def step(self) -> list[Req]:
        """Run one global step. Returns requests that got a token or finished (finished ones are forgotten by the
        driver afterwards).

        With overlap scheduling it sends the next step to the ranks first and then applies the tokens of the step
        sent by the previous call, so the returned requests are those of that previous step.

        Raises:
            RankFailure: the ranks must be restarted (every in-flight request is left to the caller to fail).
        """
        updated: list[Req] = []
        launched = self._launch_next(updated)
        if self.overlap_schedule:  # finish the previous step; this one stays in flight until the next call
            launched, self._launched = self._launched, launched
        if launched is not None:
            updated.extend(self._finish(launched))
        return self._forget_finished(updated)

    def _launch_next(self, early: list[Req]) -> _LaunchedStep | None:
        """Form every group's next batch, make the step-wide decisions and send the step; ``None`` when no group
        has work. Requests the schedulers finished while scheduling (out of KV) are appended to ``early``."""
        sched_batches = [s.get_next_batch_to_run() for s in self.schedulers]
        early.extend(r for s in self.schedulers for r in s.drain_finished())
        if all(b is None for b in sched_batches):
            return None
        global_tokens = tuple(0 if b is None else len(b.worker_batch.input_ids) for b in sched_batches)
        worker_batches = [
            ModelWorkerBatch.idle(global_tokens) if b is None
            else replace(b.worker_batch, global_num_tokens=global_tokens)
            for b in sched_batches
        ]
        # Decisions every rank must share, made once here: two-batch overlap on/off, the graph bucket, then the
        # MoE all-to-all mode and its per-rank capacity.
        worker_batches = apply_tbo_decision(worker_batches, self.config.overlap)
        worker_batches = apply_graph_plan(worker_batches, self.graph_capture_sizes)
        worker_batches = apply_dispatch_plan(worker_batches, self.a2a_mode,
                                             self.config.max_dispatch_tokens_per_rank)
        self.num_tbo_steps += worker_batches[0].use_tbo
        self.num_graph_steps += worker_batches[0].graph_bs is not None
        self.num_low_latency_steps += worker_batches[0].dispatch_capacity is not None
        mode = step_mode([b.forward_mode for b in worker_batches])  # "mixed" iff some group ran MIXED
        self.num_mixed_steps += mode == "mixed"
        launched_at = self.step_timer.clock()
        return _LaunchedStep(sched_batches, self.executor.launch(worker_batches), mode, launched_at)

    def _finish(self, launched: _LaunchedStep) -> list[Req]:
        """Wait for a launched step and apply its tokens; a step the ranks raised in fails its requests."""
        try:
            outputs = self.executor.collect(launched.handle)
        except RankStepError as e:
            return self._fail_step(e)
        self._step_errors_in_a_row = 0
        self.last_step_seconds = [o.forward_seconds for o in outputs]
        self.step_timer.collected(launched.mode, launched.launched_at, max(self.last_step_seconds, default=0.0))
        self.num_steps += 1
        self.num_idle_group_steps += sum(b is None for b in launched.sched_batches)
        updated: list[Req] = []
        for sched, batch, out in zip(self.schedulers, launched.sched_batches, outputs, strict=True):
            if batch is not None:
                updated.extend(sched.process_batch_result(batch, out))
        return updated

    def _fail_step(self, error: RankStepError) -> list[Req]:
        """A rank raised in the step: fail the step's requests (they free their KV) and keep the ranks if they all
        answer and this is not the second such step in a row.

        Raises:
            RankFailure: the ranks must be restarted (the step's requests are failed already).
        """
        self.num_failed_steps += 1
        self._step_errors_in_a_row += 1
        fault = RequestFault("failed", f"the engine could not compute this request's step ({error}); the "
                                       "other requests go on")
        alive = self.executor.ranks_alive()
        if alive and self._launched is not None:  # the next step was sent already: wait for it, drop its tokens
            following, self._launched = self._launched, None
            try:
                self.executor.collect(following.handle)
            except RankStepError:
                pass
        failed = [r for s in self.schedulers for r in s.fail_inflight(fault)]
        if self._step_errors_in_a_row >= MAX_CONSECUTIVE_STEP_ERRORS or not alive:
            self._forget_finished(failed)
            raise RankFailure(f"{self._step_errors_in_a_row} failed step(s) in a row; restarting the ranks") \
                from error
        return failed

    def idle_report(self) -> IdleReport | None:
        """The idle invariant summed over DP groups when no group holds a request (``None`` otherwise)."""
        reports = [s.idle_report() for s in self.schedulers]
        if any(r is None for r in reports):
            return None
        return IdleReport(leaked_kv_slots=sum(r.leaked_kv_slots for r in reports),
                          leaked_req_rows=sum(r.leaked_req_rows for r in reports),
                          locked_cache_tokens=sum(r.locked_cache_tokens for r in reports))

    def _forget_finished(self, updated: list[Req]) -> list[Req]:
        for req in updated:
            if req.finished:
                self.reqs.pop(req.rid, None)
                self.group_of.pop(req.rid, None)
        return updated
