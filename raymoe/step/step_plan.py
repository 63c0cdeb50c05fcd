"""The two small records of a step's agreement: what each DP group's scheduler tells the driver about its next batch
(:class:`GroupPlan`), and what the driver decides for every rank from those (:class:`StepDecision`).

Ownership: a group scheduler (``raymoe.actors.group_scheduler``) forms its batch and answers a ``GroupPlan``; the
driver (``raymoe.actors.driver``) gathers one per group, decides once (``raymoe.actors.step_decision``) and hands
every group the same ``StepDecision``, which the group applies to its own batch before its ranks receive it. So the
driver's work per step is O(dp) small records, never per-request data, and every rank of the step gets the same
decisions (a rank that disagreed on two-batch overlap, the graph bucket or the dispatch capacity would pair the
wrong collectives and hang).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from raymoe.step.expert_update import ExpertUpdate
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.worker_batch import ModelWorkerBatch


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


class PickledAsFields:
    """Mixin for the frozen dataclasses that cross a socket every step (plans, decisions, the group links'
    records): pickled as the class and its field values and rebuilt through ``__init__`` (so its checks run
    again), which unpickles about 3x faster than the default state dictionary of a frozen dataclass (measured:
    a group's reply, 14 -> 5 us)."""

    __slots__ = ()

    def __reduce__(self):
        return self.__class__, tuple(self.__dict__[name] for name in _field_names(type(self)))


@dataclass(frozen=True)
class GroupPlan(PickledAsFields):
    """One DP group's next batch as the cross-rank decisions need it.

    Attributes:
        forward_mode: the batch's mode (IDLE: the group has no work this step).
        num_tokens: tokens it computes this step. batch_size: its requests (rows).
        tbo_splittable: a two-batch-overlap split at the engine's ``tbo_token_distribution_threshold`` gives both
            children tokens (``raymoe.overlap.split``; computed by the group, which holds the extend lengths).
        draft_passes: the group wants the ranks' draft model to run after this step (``nextn`` / ``eagle``:
            ``raymoe.scheduler.spec_steps.SpecSteps.wants_draft_passes``).
    Raises:
        ValueError: negative sizes, or an IDLE plan with work.
    """

    forward_mode: ForwardMode
    num_tokens: int
    batch_size: int
    tbo_splittable: bool = False
    draft_passes: bool = False

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.batch_size < 0:
            raise ValueError(f"GroupPlan sizes must be >= 0, got {self.num_tokens} tokens, {self.batch_size} rows")
        if self.forward_mode == ForwardMode.IDLE and (self.num_tokens or self.batch_size):
            raise ValueError("an IDLE GroupPlan carries no requests")

    @classmethod
    def idle(cls) -> GroupPlan:
        """The plan of a group without work."""
        return cls(ForwardMode.IDLE, 0, 0)


@dataclass(frozen=True)
class StepDecision(PickledAsFields):
    """The decisions every rank of a step shares (``ModelWorkerBatch``'s step-wide fields).

    Attributes:
        global_num_tokens: tokens per DP group this step. use_tbo: two-batch overlap on every rank.
        graph_bs: the decode-graph bucket every rank replays (None: eager). dispatch_capacity: the low-latency
            MoE dispatch's per-rank capacity M, tokens (None: normal mode). expert_update: the step's expert load
            balancing work (``raymoe.step.expert_update``; None: none). draft_passes: every rank runs the draft
            model's passes after the step (some group wants drafts; the passes hold MoE collectives, so all ranks or
            none). draft_graph_bs: the graph bucket every rank replays the draft model's decode passes in (None:
            eager passes; ``raymoe.runner.mtp_drafter``).
    """

    global_num_tokens: tuple[int, ...]
    use_tbo: bool = False
    graph_bs: int | None = None
    dispatch_capacity: int | None = None
    expert_update: ExpertUpdate | None = None
    draft_passes: bool = False
    draft_graph_bs: int | None = None

    def apply(self, batch: ModelWorkerBatch | None) -> ModelWorkerBatch:
        """``batch`` with this step's decisions (one copy, ``ModelWorkerBatch.with_step_decisions``: the batch's
        own columns are not checked again); an IDLE batch for a group without one.

        Raises:
            ValueError: the decisions do not fit the batch (its tokens above ``dispatch_capacity``).
        """
        return (ModelWorkerBatch.idle() if batch is None else batch).with_step_decisions(
            self.global_num_tokens, self.use_tbo, self.graph_bs, self.dispatch_capacity, self.expert_update,
            self.draft_passes, self.draft_graph_bs)
