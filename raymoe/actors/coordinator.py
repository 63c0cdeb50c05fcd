"""StepCoordinator: what every driver keeps whichever process its DP groups' schedulers run in: the rules of the
step's shared decisions, the request -> group table, and the step counters.

Two drivers build on it: :class:`~raymoe.actors.driver.Driver` holds its groups' schedulers in its own process
(one engine, one loop; the single-rank engine and small deployments), and :class:`~raymoe.actors.hosted_driver.
HostedDriver` talks to group servers in processes of their own (``EngineConfig.group_schedulers``). Both make the
decisions every rank must agree on once per step from the groups' plans (``raymoe.actors.step_decision``), so the
deadlock rules hold the same way in both.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from raymoe.actors.step_decision import StepRules, decide_step
from raymoe.actors.step_timing import StepTimer, step_mode
from raymoe.config import EngineConfig
from raymoe.eplb.controller import EplbController
from raymoe.step.step_plan import GroupPlan, StepDecision

# Failed steps in a row (RankStepError) after which the ranks are restarted even though they answer.
MAX_CONSECUTIVE_STEP_ERRORS = 2


class StepCoordinator:
    """Decision rules, routing table and counters shared by the drivers (module docstring).

    Args:
        config: engine configuration. executor: the ranks (and, for a hosted driver, the group processes).
        graph_capture_sizes: decode-graph buckets the ranks captured (empty: always eager).
        vocab_size: token ids must lie in ``[0, vocab_size)`` (None: unchecked; checked by the groups).
        a2a_mode: the MoE all-to-all mode the ranks were built with (None: the config's).
        eplb: the expert-load window and rebalance planner (``raymoe.eplb.controller``; None: the ranks record no
            expert load). Its update joins every step's decision.

    Attributes:
        group_of: unfinished request id -> its DP group. num_steps, num_tbo_steps, num_graph_steps,
            num_low_latency_steps, num_mixed_steps: collected steps, and those with two-batch overlap, a replayed
            graph, a low-latency dispatch, a MIXED batch in some group. num_failed_steps: steps a rank raised in.
            last_step_seconds: forward+sample seconds of each DP group's tp-rank 0 in the last step.
            step_timer: period and forward time of collected steps by mode (``/metrics``).
    """

    def __init__(self, config: EngineConfig, executor, graph_capture_sizes: Sequence[int] = (),
                 vocab_size: int | None = None, a2a_mode: str | None = None, eplb: EplbController | None = None):
        self.config = config
        self.eplb = eplb
        self.a2a_mode = a2a_mode or config.moe_comm.a2a_mode
        self.executor = executor
        self.graph_capture_sizes = tuple(graph_capture_sizes)
        self.vocab_size = vocab_size
        self.rules = StepRules(config.overlap, self.graph_capture_sizes, self.a2a_mode,
                               config.max_dispatch_tokens_per_rank)
        self.group_of: dict[str, int] = {}
        self.record_outputs = False  # the serving loop sets it: groups write output rows for the front end
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_tbo_steps = 0
        self.num_graph_steps = 0
        self.num_low_latency_steps = 0
        self.num_mixed_steps = 0
        self.num_failed_steps = 0
        self._failed_before_reset = 0
        self._step_errors_in_a_row = 0
        self.last_step_seconds: list[float] = []
        self.step_timer = StepTimer()
        # with speculation, verify and draft steps run one at a time (the driver's rule, raymoe.actors.driver)
        self.overlap_schedule = not config.scheduler.disable_overlap_schedule

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}"

    def _decide(self, plans: Sequence[GroupPlan]) -> tuple[StepDecision, str]:
        """The step's shared decisions from every group's plan, counted; also its ``step_mode`` label."""
        decision = decide_step(plans, self.rules)
        if self.eplb is not None:
            update = self.eplb.next_update()
            if update is not None:
                decision = dataclasses.replace(decision, expert_update=update)
        self.num_tbo_steps += decision.use_tbo
        self.num_graph_steps += decision.graph_bs is not None
        self.num_low_latency_steps += decision.dispatch_capacity is not None
        mode = step_mode([p.forward_mode for p in plans])  # "mixed" iff some group ran MIXED
        self.num_mixed_steps += mode == "mixed"
        return decision, mode

    def _collected(self, mode: str, launched_at: float, seconds: list[float],
                   expert_loads: Sequence[list[int] | None] = ()) -> None:
        """Count a step the ranks computed: ``seconds`` is each group's tp-rank-0 forward time, ``expert_loads``
        the expert-load counters its groups attached (``StepOutput.expert_load``)."""
        if self.eplb is not None and any(x is not None for x in expert_loads):
            self.eplb.record(expert_loads)
        self._step_errors_in_a_row = 0
        self.last_step_seconds = seconds
        self.step_timer.collected(mode, launched_at, max(seconds, default=0.0))
        self.num_steps += 1

    def _step_failed(self) -> bool:
        """Count a step a rank raised in; True when the ranks must be restarted although they answer."""
        self.num_failed_steps += 1
        self._step_errors_in_a_row += 1
        return self._step_errors_in_a_row >= MAX_CONSECUTIVE_STEP_ERRORS
