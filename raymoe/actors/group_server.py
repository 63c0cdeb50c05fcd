"""GroupServer: one DP group's scheduling, its ranks' steps and its output rows, answering the driver's commands.

A group server is what runs in a group's own process (``raymoe.actors.group_actor``) when the engine's groups do
not share the driver's (``EngineConfig.group_schedulers``). It owns the group's
:class:`~raymoe.actors.group_scheduler.GroupScheduler` (requests, radix cache, KV allocators), the link to the
group's ranks (:class:`GroupRanks`: their step channel, so each rank gets its batch from its own group's process)
and the publisher of the group's output rows (straight to the front end, never through the driver). The driver
sends it one :class:`~raymoe.actors.group_messages.GroupCommand` per step and reads one
:class:`~raymoe.actors.group_messages.GroupReply` (:meth:`GroupServer.handle`).

The order inside a step command keeps the driver's overlap semantics: the step formed at the end of the previous
exchange is sent to the ranks first, then the oldest step in flight is finished (so the ranks compute the next step
while this process applies tokens, checks stops and publishes rows), then aborts and new requests are applied and
the next batch is formed. A step the ranks raised in is reported, not handled: whether to fail the group's
in-flight requests or restart every rank is the driver's call, for all groups at once (``"fail_inflight"``).

The class is plain Python: the served engine runs it in a Ray actor; tests and ``raymoe bench driver-scale`` run it
in-process behind a pickling loopback link (``raymoe.actors.group_link.LoopbackLink``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from raymoe.actors.group_messages import GroupCommand, GroupControl, GroupReply
from raymoe.actors.group_scheduler import GroupScheduler
from raymoe.actors.output_batch import OutputBatch
from raymoe.actors.step_errors import RankFailure, RankStepError
from raymoe.step.step_output import StepOutput
from raymoe.step.step_plan import GroupPlan
from raymoe.step.worker_batch import ModelWorkerBatch


class GroupRanks(Protocol):
    """A group's ranks, as its server drives them: ``launch`` sends a batch without waiting (ranks run steps in
    launch order) and ``collect`` waits for the group's tp-rank-0 output of a launched step.

    ``collect`` raises :class:`RankStepError` (a rank raised; all answered) or :class:`RankFailure` (a rank died,
    hung or failed a collective); ``alive`` says whether every rank answered its last step."""

    def launch(self, batch: ModelWorkerBatch) -> Any: ...

    def collect(self, handle: Any) -> StepOutput: ...

    def alive(self) -> bool: ...


class ExecutorRanks:
    """:class:`GroupRanks` over a one-group step executor (``launch(batches)`` / ``collect(handle)`` /
    ``ranks_alive()``, as ``raymoe.actors.driver.StepExecutor``): tests and benchmarks."""

    def __init__(self, executor):
        self.executor = executor

    def launch(self, batch: ModelWorkerBatch) -> Any:
        return self.executor.launch([batch])

    def collect(self, handle: Any) -> StepOutput:
        return self.executor.collect(handle)[0]

    def alive(self) -> bool:
        return self.executor.ranks_alive()


class GroupServer:
    """Serves one group's commands (module docstring).

    Args:
        group: the group's scheduler (a fresh one replaces it on ``"reset"``: ``make_group``).
        ranks: the group's ranks. publish: sends an :class:`OutputBatch` of this group's rows to the front end(s)
            (must not block for long; an exception is left to the caller of :meth:`handle`).
        make_group: builds a fresh :class:`GroupScheduler` (``"reset"``).
    """

    def __init__(self, group: GroupScheduler, ranks: GroupRanks, publish: Callable[[OutputBatch], None],
                 make_group: Callable[[], GroupScheduler]):
        self.group = group
        self.ranks = ranks
        self.publish = publish
        self.make_group = make_group
        self._handles: deque[Any] = deque()  # launched steps not yet finished, oldest first

    def handle(self, msg: GroupCommand | GroupControl) -> GroupReply:
        """Apply one command or control and answer it.

        Raises:
            TypeError: ``msg`` is neither record.
        """
        if isinstance(msg, GroupCommand):
            return self._step(msg)
        if isinstance(msg, GroupControl):
            return getattr(self, f"_control_{msg.kind}")(msg)
        raise TypeError(f"a group server takes GroupCommand or GroupControl, got {type(msg).__name__}")

    # ------------------------------------------------------------------------------------------------- steps
    def _step(self, cmd: GroupCommand) -> GroupReply:
        g = self.group
        step_error = rank_failure = None
        forward_seconds = expert_load = None
        if cmd.decision is not None:
            batch = g.batch_for(cmd.decision)
            try:
                self._handles.append(self.ranks.launch(batch))
            except RankFailure as e:
                rank_failure = str(e)
        if cmd.finish and rank_failure is None:
            try:
                out = self.ranks.collect(self._handles.popleft())
            except RankStepError as e:
                step_error = str(e)
            except RankFailure as e:
                rank_failure = str(e)
            else:
                forward_seconds, expert_load = out.forward_seconds, out.expert_load
                g.record(g.finish(out))
        for rid in cmd.aborts:
            g.abort(rid, cmd.abort_error)
        for a in cmd.adds:
            g.add(a.request_id, a.prompt_token_ids, a.params, output_ids=a.output_ids)
        plan = None
        if step_error is None and rank_failure is None:  # after a failed step the driver decides first
            plan = self._plan()
        return self._reply(plan, forward_seconds=forward_seconds, step_error=step_error, rank_failure=rank_failure,
                           expert_load=expert_load)

    def _plan(self) -> GroupPlan:
        plan, early = self.group.plan()
        self.group.record(early)
        return plan

    def _reply(self, plan: GroupPlan | None, **fields) -> GroupReply:
        out = self.group.take_outputs()
        if len(out):
            self.publish(out)
        return GroupReply(plan, self.group.stats(), tuple(out.ended_ids()), ranks_alive=self.ranks.alive(),
                          prefix_delta=self.group.take_prefix_delta(), **fields)

    # ----------------------------------------------------------------------------------------------- controls
    def _control_fail_inflight(self, msg: GroupControl) -> GroupReply:
        alive = self.ranks.alive()
        while self._handles:  # wait for the steps the ranks were sent (when they answer) and drop their tokens
            handle = self._handles.popleft()
            if alive:
                try:
                    self.ranks.collect(handle)
                except (RankStepError, RankFailure):
                    alive = self.ranks.alive()
        self.group.record(self.group.fail_inflight(msg.fault))
        return self._reply(self._plan())

    def _control_end_all(self, msg: GroupControl) -> GroupReply:
        n = self.group.end_all(msg.error)
        return self._reply(None, ended_count=n)

    def _control_reset(self, msg: GroupControl) -> GroupReply:
        self._handles.clear()
        self.group = self.make_group()
        return self._reply(GroupPlan.idle())

    def _control_idle_report(self, msg: GroupControl) -> GroupReply:
        return self._reply(None, idle=self.group.scheduler.idle_report())

    def _control_flush_cache(self, msg: GroupControl) -> GroupReply:
        self.group.scheduler.flush_cache()  # the prefix index learns it from the tree's events
        return self._reply(None)

    def _control_stop(self, msg: GroupControl) -> GroupReply:
        return self._reply(None)
