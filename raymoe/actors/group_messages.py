"""The records between the driver and a DP group's scheduler when the group runs in a process of its own
(``raymoe.actors.group_server``): one :class:`GroupCommand` or :class:`GroupControl` from the driver, one
:class:`GroupReply` back, per group and exchange.

Per step the driver sends each group one command and reads one reply, both a few hundred bytes whatever the
number of requests: the step's shared decisions (:class:`~raymoe.step.step_plan.StepDecision`), whether to finish
the oldest step in flight, the requests routed to the group since the last exchange and aborts; back come the
group's next :class:`~raymoe.step.step_plan.GroupPlan`, a few counters (:class:`GroupStats`), the ids of the
requests that ended (so the driver can route aborts and end a lost group's requests) and the block hashes its radix
tree stored and evicted (so the driver can route by cached prefix, ``raymoe.actors.dp_router``). Token ids and
output rows never pass through the driver: the group sends them to the front end itself.

Ownership: the driver builds commands (``raymoe.actors.hosted_driver``); a group server applies them and builds
replies. Plain frozen data, picklable.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.actors.records import AddRequest, RequestError
from raymoe.kvcache.prefix_events import PrefixDelta
from raymoe.scheduler.accounting import IdleReport
from raymoe.scheduler.req import RequestFault
from raymoe.scheduler.spec_steps import SpecCounters
from raymoe.step.step_plan import GroupPlan, PickledAsFields, StepDecision

CONTROL_KINDS = ("fail_inflight", "end_all", "reset", "idle_report", "flush_cache", "stop")
"""What a :class:`GroupControl` asks: fail the steps in flight (after waiting for the ranks to answer them), end
every request with an error, forget every request (fresh scheduler), report the idle invariant, drop the radix
cache (idle only: after a weight update), stop serving."""


@dataclass(frozen=True)
class GroupCommand(PickledAsFields):
    """One step exchange, applied by the group in this order: send its batch of ``decision`` to its ranks (None:
    no step is launched); finish the oldest step in flight (``finish``: wait for the ranks' output, apply tokens,
    publish rows); abort ``aborts``; queue ``adds``; form the next batch and answer its plan.

    Attributes:
        decision: the step's shared decisions, or None. finish: finish the oldest step in flight.
        adds: requests routed to this group since the last exchange. aborts: request ids to abort.
        abort_error: how the aborted requests end (None: ``finish_reason`` ``"abort"``; an error: requests
            retracted for a weight update; the front end no longer reads the streams a client aborted).
    Raises:
        ValueError: an add with a duplicate id in one command.
    """

    decision: StepDecision | None = None
    finish: bool = False
    adds: tuple[AddRequest, ...] = ()
    aborts: tuple[str, ...] = ()
    abort_error: RequestError | None = None

    def __post_init__(self) -> None:
        ids = [a.request_id for a in self.adds]
        if len(ids) != len(set(ids)):
            raise ValueError("GroupCommand.adds has a duplicate request id")


@dataclass(frozen=True)
class GroupControl(PickledAsFields):
    """A command outside the step loop (kinds: :data:`CONTROL_KINDS`).

    Attributes:
        kind: what to do. fault: why in-flight requests fail (``"fail_inflight"``). error: how every request ends
            (``"end_all"``).
    Raises:
        ValueError: an unknown kind, or a kind without the record it needs.
    """

    kind: str
    fault: RequestFault | None = None
    error: RequestError | None = None

    def __post_init__(self) -> None:
        if self.kind not in CONTROL_KINDS:
            raise ValueError(f"GroupControl.kind must be one of {CONTROL_KINDS}, got {self.kind!r}")
        if self.kind == "fail_inflight" and self.fault is None:
            raise ValueError("GroupControl('fail_inflight') needs a fault")
        if self.kind == "end_all" and self.error is None:
            raise ValueError("GroupControl('end_all') needs an error")


@dataclass(frozen=True)
class GroupStats(PickledAsFields):
    """A group's counters after an exchange (for routing, ``/metrics`` and ``has_unfinished``).

    Attributes:
        num_running, num_waiting: requests holding KV / queued. kv_usage: fraction of KV slots in use, 0..1.
        hit_tokens: prompt tokens served from the radix cache so far. failed_requests: requests ended with a
        ``"failed"`` error so far. num_idle_steps: steps the group ran IDLE. num_retractions: requests pushed back
        by KV exhaustion so far. has_work: a request is unfinished or a step is in flight. spec: speculative
        decoding's counters (``raymoe.scheduler.spec_steps``), None when it is off.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    hit_tokens: int = 0
    failed_requests: int = 0
    num_idle_steps: int = 0
    num_retractions: int = 0
    has_work: bool = False
    spec: SpecCounters | None = None


@dataclass(frozen=True)
class GroupReply(PickledAsFields):
    """A group's answer to a command or control.

    Attributes:
        plan: its next batch's plan (None when it did not plan: after a failed step, or for most controls).
        stats: its counters. ended: ids of the requests that ended during the exchange (finished, aborted,
            refused, failed). forward_seconds: forward + sampling seconds of the step it finished on its tp-rank 0
            (None: it finished none). step_error: a rank raised in the step it finished (the message; the ranks
            answered). rank_failure: a rank died, hung or failed a collective (the message). ranks_alive: every
            rank of the group answered its last step. idle: the idle invariant (``"idle_report"`` only; None while
            a request is held). ended_count: requests ended by ``"end_all"``. internal_error: the group's own code
            raised (its type and message; the driver then fails every in-flight request and resets the groups).
            expert_load: the expert-load counters its tp-rank 0 attached to the step it finished
            (``StepOutput.expert_load``), or None. prefix_delta: the block hashes its radix tree stored and evicted
            since its last reply (``raymoe.kvcache.prefix_events``; the driver's router indexes them), or None.
    """

    plan: GroupPlan | None
    stats: GroupStats
    ended: tuple[str, ...] = ()
    forward_seconds: float | None = None
    step_error: str | None = None
    rank_failure: str | None = None
    ranks_alive: bool = True
    idle: IdleReport | None = None
    ended_count: int = 0
    internal_error: str | None = None
    expert_load: list[int] | None = None
    prefix_delta: PrefixDelta | None = None
