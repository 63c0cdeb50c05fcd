"""Driver: global scheduling over every DP-attention group.

Ownership: the driver owns the requests, and per DP group a ``Scheduler`` (waiting queue, running batch, slot
allocators, radix cache). Every step it asks each group's scheduler for a batch, gives groups without work an
IDLE batch (so their ranks still enter every MoE collective), makes the decisions all ranks must agree on, hands
the batches to an executor that fans them out to the ranks, and feeds the sampled tokens back to the schedulers.

Written as a plain class: the single-rank engine runs it in-process; the cluster engine wraps it in a Ray actor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from raymoe.comm.a2a_plan import apply_dispatch_plan
from raymoe.config import EngineConfig
from raymoe.errors import InvalidRequestError
from raymoe.overlap.decision import apply_tbo_decision
from raymoe.runner.graph_buckets import apply_graph_plan
from raymoe.scheduler.req import Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.scheduler import Scheduler
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch


class StepExecutor(Protocol):
    """Runs one global step: one ``ModelWorkerBatch`` per DP group -> one ``StepOutput`` per DP group."""

    def execute(self, batches: list[ModelWorkerBatch]) -> list[StepOutput]: ...


class Driver:
    """Schedules requests over ``dp_size`` groups and runs steps through ``executor``.

    Args:
        config: engine configuration (cache and scheduler limits apply per DP group).
        executor: fans batches out to ranks.
        eos_token_ids: the model's end-of-sequence ids.
        detokenize: token ids -> text (stop strings).
        dp_size: number of DP-attention groups.
        graph_capture_sizes: decode-graph buckets the ranks captured (empty: always eager).
        vocab_size: token ids must lie in ``[0, vocab_size)`` (None: unchecked); checked here so that no front end
            can send a rank an id its embedding cannot look up.
        a2a_mode: the MoE all-to-all mode the ranks were built with (``RunnerConfig.a2a_mode``; None: the
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
                                     detokenize=detokenize) for _ in range(dp_size)]
        self.reqs: dict[str, Req] = {}
        self.group_of: dict[str, int] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_idle_group_steps = 0
        self.num_tbo_steps = 0
        self.num_graph_steps = 0
        self.num_low_latency_steps = 0  # steps whose MoE dispatch ran in low-latency mode
        self.last_step_seconds: list[float] = []  # forward+sample seconds of each DP group's tp-rank 0

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}"

    def _route(self, input_ids: Sequence[int]) -> int:
        """Pick the DP group: the least loaded one (running + waiting requests), ties to the lowest index."""
        loads = [s.num_running + s.num_waiting for s in self.schedulers]
        return loads.index(min(loads))

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> Req:
        """Queue a request on a DP group.

        Raises:
            InvalidRequestError: the prompt is empty or too long, or the queue is full (names the field).
        """
        if rid in self.reqs:
            raise ValueError(f"duplicate request id {rid!r}")
        if self.vocab_size is not None and input_ids and not 0 <= min(input_ids) <= max(input_ids) < self.vocab_size:
            raise InvalidRequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
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
                                     detokenize=s.detokenize) for s in self.schedulers]
        self.reqs.clear()
        self.group_of.clear()
        return dropped

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def step(self) -> list[Req]:
        """Run one global step. Returns requests that got a token or finished this step (finished ones are
        forgotten by the driver afterwards)."""
        sched_batches = [s.get_next_batch_to_run() for s in self.schedulers]
        # Requests the schedulers finished while scheduling (e.g. out of KV) are reported too.
        early = [r for s in self.schedulers for r in s.drain_finished()]
        if all(b is None for b in sched_batches):
            return self._forget_finished(early)
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
        outputs = self.executor.execute(worker_batches)
        self.last_step_seconds = [o.forward_seconds for o in outputs]
        self.num_steps += 1
        self.num_idle_group_steps += sum(b is None for b in sched_batches)
        updated: list[Req] = early
        for sched, batch, out in zip(self.schedulers, sched_batches, outputs, strict=True):
            if batch is not None:
                updated.extend(sched.process_batch_result(batch, out))
        return self._forget_finished(updated)

    def _forget_finished(self, updated: list[Req]) -> list[Req]:
        for req in updated:
            if req.finished:
                self.reqs.pop(req.rid, None)
                self.group_of.pop(req.rid, None)
        return updated
