"""GroupScheduler: everything the engine does per request for one DP-attention group, beside the group's ranks.

Ownership: a group scheduler owns its group's ``Scheduler`` (waiting queue, running batch, KV allocators, radix
cache), its requests, the batches it sent and not yet got back, and the outputs it publishes. The driver
(``raymoe.actors.driver``) owns none of that: every step it asks each group for a :class:`~raymoe.step.step_plan.
GroupPlan` (:meth:`GroupScheduler.plan`), decides once for every rank (``raymoe.actors.step_decision``), and gives
each group the same :class:`~raymoe.step.step_plan.StepDecision` (:meth:`GroupScheduler.batch_for`), so the
driver's share of a step is O(dp) small records whatever the number of requests.

Per step a group: forms its next batch and answers its plan; applies the decision to that batch (one copy) for its
ranks; takes its ranks' output of the oldest step it sent (:meth:`GroupScheduler.finish`: tokens, stop checks, KV
freed); and writes one row per request that advanced or ended into its :class:`~raymoe.actors.output_batch.
OutputBatch` (:meth:`GroupScheduler.take_outputs`). A request that is refused, aborted or failed ends in a row too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from raymoe.actors.group_messages import GroupStats
from raymoe.actors.output_batch import OutputBatch, RequestEnd
from raymoe.actors.records import RequestError
from raymoe.config import EngineConfig
from raymoe.errors import InvalidRequestError
from raymoe.kvcache.prefix_events import PrefixDelta, PrefixEventLog
from raymoe.overlap.decision import plan_of
from raymoe.scheduler.req import FinishKind, Req, RequestFault
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.scheduler.scheduler import Scheduler
from raymoe.step.step_output import StepOutput
from raymoe.step.step_plan import GroupPlan, StepDecision
from raymoe.step.worker_batch import ModelWorkerBatch


class GroupScheduler:
    """One DP group's scheduling, results and outputs (module docstring).

    Args:
        index: the group's DP rank. config: the engine's configuration (cache and scheduler limits are per group).
        eos_token_ids: the model's end-of-sequence ids. detokenize: token ids -> text (stop strings).
        vocab_size: prompt ids must lie in ``[0, vocab_size)`` (None: unchecked).

    Attributes:
        scheduler: the group's :class:`~raymoe.scheduler.scheduler.Scheduler`. reqs: its unfinished requests by id.
        num_idle_steps: steps the group ran IDLE (no work, its ranks still in every collective).
        failed_requests: requests that ended with a ``"failed"`` error.
        prefix_events: the block hashes its radix tree stored and evicted since the last
            :meth:`take_prefix_delta` (``load_balance_method="prefix_aware"``; None otherwise).
    """

    def __init__(self, index: int, config: EngineConfig, eos_token_ids: Sequence[int],
                 detokenize: Callable[[Sequence[int]], str] | None, vocab_size: int | None):
        self.index = index
        self.scheduler = Scheduler(config.scheduler, config.cache, eos_token_ids=eos_token_ids,
                                   detokenize=detokenize, vocab_size=vocab_size, speculative=config.speculative)
        self.tbo_threshold = config.overlap.tbo_token_distribution_threshold
        self.reqs: dict[str, Req] = {}
        self.num_idle_steps = 0
        self.failed_requests = 0
        self._formed: ScheduleBatch | None = None  # planned, not yet sent
        self._inflight: deque[ScheduleBatch | None] = deque()  # sent, oldest first (None: the group ran IDLE)
        self._sent: dict[str, int] = {}  # unfinished request -> output tokens already in an output row
        self._out = OutputBatch()
        self.prefix_events: PrefixEventLog | None = None
        if config.scheduler.load_balance_method == "prefix_aware":
            self.prefix_events = PrefixEventLog()
            self.scheduler.tree_cache.record_events(self.prefix_events)

    def take_prefix_delta(self) -> PrefixDelta | None:
        """What the group's radix tree gained and lost since the last call (for the driver's router), or None."""
        return self.prefix_events.drain() if self.prefix_events is not None else None

    # ------------------------------------------------------------------------------------------------ requests
    def add(self, rid: str, input_ids: list[int], params: SamplingParams, report: bool = True,
            output_ids: Sequence[int] = (), export_kv: bool = False, kv_stream=None) -> Req | None:
        """Queue a request; ``output_ids``: the tokens a resumed request generated before a fault (its rows then
        carry only the tokens after them); ``export_kv``: keep its prompt's KV locked for a decode engine when it
        finishes (``GroupState.kv_exports``); ``kv_stream``: write it into the decode engine's reservation layer by
        layer while computing it (``raymoe.step.kv_stream.KVStreamTarget``). Refused (``InvalidRequestError``):
        with ``report`` its row ends it with the error (None is returned), else the error is raised."""
        req = Req(rid, list(input_ids), params, output_ids=[int(t) for t in output_ids],
                  output_logprobs=[None] * len(output_ids), export_kv=export_kv, kv_stream=kv_stream)
        try:
            self.scheduler.add_request(req)
        except InvalidRequestError as e:
            if not report:
                raise
            self._out.end(rid, RequestEnd(error=RequestError("invalid", e.message, e.field)))
            return None
        self.reqs[rid] = req
        self._sent[rid] = len(req.output_ids)
        return req

    def abort(self, rid: str, error: RequestError | None = None) -> bool:
        """Abort ``rid`` (its KV is freed) and end its row with ``"abort"``, or with ``error`` (a request retracted
        for a weight update); False when it is not here."""
        if self.reqs.pop(rid, None) is None:
            return False
        self.scheduler.abort_request(rid)
        self._sent.pop(rid, None)
        self._out.end(rid, RequestEnd(error=error) if error is not None else RequestEnd(finish_reason="abort"))
        return True

    # --------------------------------------------------------------------------------------------------- steps
    def plan(self) -> tuple[GroupPlan, list[Req]]:
        """Form the next batch (KV allocated, recorded in flight by the scheduler) and answer its plan; also the
        requests the scheduler finished while forming it (``Scheduler.drain_finished``)."""
        self._formed = self.scheduler.get_next_batch_to_run()
        early = self.scheduler.drain_finished()
        self._forget(early)
        spec = self.scheduler.spec
        wants = spec is not None and spec.wants_draft_passes()
        return plan_of(self._formed.worker_batch if self._formed else None, self.tbo_threshold, wants), early

    def batch_for(self, decision: StepDecision) -> ModelWorkerBatch:
        """The planned batch with the step's decisions (an IDLE batch without one), recorded as sent."""
        batch, self._formed = self._formed, None
        self._inflight.append(batch)
        return decision.apply(batch.worker_batch if batch is not None else None)

    def finish(self, output: StepOutput) -> list[Req]:
        """Apply the ranks' output of the oldest step sent; returns the requests that got a token or finished."""
        batch = self._inflight.popleft()
        if batch is None:
            self.num_idle_steps += 1
            return []
        updated = self.scheduler.process_batch_result(batch, output)
        self._forget(updated)
        return updated

    def fail_inflight(self, fault: RequestFault) -> list[Req]:
        """The steps in flight failed on the ranks: fail their requests (KV freed) and forget them."""
        self._inflight.clear()
        self._formed = None
        failed = self.scheduler.fail_inflight(fault)
        self._forget(failed)
        return failed

    def has_work(self) -> bool:
        """Whether a request is unfinished or a step sent by this group is still in flight."""
        return bool(self._inflight) or self.scheduler.has_unfinished()

    def stats(self) -> GroupStats:
        """The group's counters (O(1))."""
        s = self.scheduler
        return GroupStats(num_running=s.num_running, num_waiting=s.num_waiting, kv_usage=s.kv_usage(),
                          hit_tokens=s.hit_tokens, failed_requests=self.failed_requests,
                          num_idle_steps=self.num_idle_steps, num_retractions=s.num_retractions,
                          has_work=self.has_work(), spec=s.spec.counters() if s.spec is not None else None)

    def _forget(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req.finished_reason is not None:
                self.reqs.pop(req.rid, None)

    # ------------------------------------------------------------------------------------------------- outputs
    def record(self, reqs: list[Req]) -> None:
        """Write a row for each of ``reqs`` (new tokens, and how it ended), in order; a request whose row cannot
        be built fails alone (its KV freed).

        The common row, one new token of a request that goes on and asked no log-probabilities, is gathered into
        columns and appended in runs (``OutputBatch.add_next_tokens``); every other row is built by
        :meth:`_record_one`."""
        sent, out = self._sent, self._out
        rids: list[str] = []
        tokens: list[int] = []
        counts: list[int] = []
        for req in reqs:
            rid = req.rid
            done = sent.get(rid)
            if (done is not None and req.finished_reason is None and req.sampling_params.logprobs is None
                    and (done or not req.prompt_logprobs)):  # a first row with prompt log-probs: _record
                outputs = req.output_ids
                n = len(outputs)
                if n == done + 1:
                    sent[rid] = n
                    rids.append(rid)
                    tokens.append(outputs[-1])
                    counts.append(n)
                    continue
            if rids:  # keep the rows in order
                out.add_next_tokens(rids, tokens, counts)
                rids, tokens, counts = [], [], []
            self._record_one(req)
        if rids:
            out.add_next_tokens(rids, tokens, counts)

    def _record_one(self, req: Req) -> None:
        try:
            self._record(req)
        except Exception as e:  # noqa: BLE001 - this request's output could not be built: fail it only
            self._sent.pop(req.rid, None)
            if self.reqs.pop(req.rid, None) is not None:
                self.scheduler.abort_request(req.rid)
            self.failed_requests += 1
            self._out.end(req.rid, RequestEnd(error=RequestError(
                "failed", f"building the request's output failed ({type(e).__name__})")))

    def _record(self, req: Req) -> None:
        sent = self._sent.get(req.rid)
        if sent is None:  # aborted while its step was in flight
            return
        reason = req.finished_reason
        if req.finished:
            del self._sent[req.rid]
        else:
            self._sent[req.rid] = len(req.output_ids)
        if reason is not None and reason.kind == FinishKind.ERROR:
            fault = reason.fault
            self.failed_requests += fault is None or fault.kind == "failed"
            err = (RequestError(fault.kind, fault.message, fault.field) if fault is not None
                   else RequestError("failed", reason.message or "the request failed"))
            self._out.end(req.rid, RequestEnd(error=err))
            return
        logprobs = req.output_logprobs[sent:] if req.sampling_params.logprobs is not None else None
        prompt = list(req.prompt_logprobs) if sent == 0 and req.prompt_logprobs and req.output_ids else None
        end = None
        if reason is not None:
            end = RequestEnd(reason.kind.value, reason.matched, len(req.origin_input_ids), req.cached_tokens,
                             accepted_prediction_tokens=req.accepted_draft_tokens,
                             rejected_prediction_tokens=req.rejected_draft_tokens)
        self._out.add(req.rid, req.output_ids[sent:], len(req.output_ids), logprobs, end, prompt)

    def end_all(self, error: RequestError) -> int:
        """End every unfinished request of this group with ``error`` (rows only; the caller resets the group);
        returns how many."""
        for rid in self._sent:
            self._out.end(rid, RequestEnd(error=error))
        n = len(self._sent)
        self.failed_requests += n if error.kind == "failed" else 0
        self._sent.clear()
        return n

    def take_outputs(self) -> OutputBatch:
        """The rows written since the last call."""
        out, self._out = self._out, OutputBatch()
        return out
