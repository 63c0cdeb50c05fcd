"""Per-DP-group scheduler (driver side, plain Python; never touches model tensors).

Ownership: the Driver owns one ``Scheduler`` per DP-attention group. The scheduler owns that group's
:class:`~raymoe.scheduler.group_state.GroupState` (``TokenSlotAllocator`` for KV slots, ``ReqSlotAllocator`` for
ReqToTokenPool rows, ``RadixCache``, every accepted ``Req``) and composes the components that work on it, one
concern each: ``intake`` (accept, abort, fail), ``batch_formation`` (prefill admission, MIXED and decode steps),
``retraction`` (free KV for decode), ``results`` (apply a step's tokens) and ``accounting`` (usage and audits).

Each step the driver calls :meth:`Scheduler.get_next_batch_to_run`, ships ``batch.worker_batch`` to the ranks, and
hands their ``StepOutput`` to :meth:`Scheduler.process_batch_result`. At most two batches may be in flight
(overlap scheduling: step N+1 is formed while step N runs, its rows read step N's tokens through placeholders, see
``raymoe.scheduler.req``); results are processed oldest first.

Request life cycle: ``waiting`` -> admitted by the ``PrefillAdder`` (a long prompt stays ``chunked_req`` until its
last chunk is scheduled) -> ``running`` (decodes one token per step) -> finished, or retracted back to
``waiting`` when decode runs out of KV (it later re-prefills ``origin_input_ids + output_ids`` and continues). A
request whose next decode step would need more KV than the whole pool finishes with LENGTH in
``process_batch_result``, so the last running request can always decode; finishing it for lack of KV is only a
defensive fallback (such requests are returned by :meth:`Scheduler.drain_finished`, which the driver should poll
every step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from raymoe.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from raymoe.scheduler import accounting
from raymoe.scheduler.accounting import IdleReport
from raymoe.scheduler.batch_formation import MAX_INFLIGHT, BatchFormation
from raymoe.scheduler.group_state import GroupState, TokenRatioPolicy
from raymoe.scheduler.intake import RequestIntake
from raymoe.scheduler.req import Req, RequestFault
from raymoe.scheduler.request_rules import RequestLimits
from raymoe.scheduler.results import StopRules, apply_batch_result, check_oldest
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.scheduler.spec_steps import SpecSteps, apply_verify_result
from raymoe.step.step_output import StepOutput

__all__ = ["IdleReport", "Scheduler"]


def _state_view(name: str, doc: str) -> property:
    """A read-only attribute of the scheduler that reads ``GroupState.<name>`` on each access (the state rebinds
    some of them, e.g. ``waiting``)."""
    return property(lambda self: getattr(self.state, name), doc=doc)


class Scheduler:
    """Waiting queue, running set, KV accounting and batch formation of one DP-attention group.

    Args:
        config: scheduling limits.
        cache_config: KV pool size (``max_total_tokens`` slots), ``max_context_len``, radix cache on/off.
        eos_token_ids: the model's end-of-sequence token ids.
        detokenize: token ids -> text; required for requests with stop strings.
        vocab_size: prompt token ids must lie in ``[0, vocab_size)`` (None: unchecked).
        init_new_token_ratio: fraction of a request's remaining ``max_tokens`` reserved in KV when admitting
            new requests (lower admits more and risks retraction); decays per decode step.
        min_new_token_ratio: floor of that fraction.
        new_token_ratio_decay: amount subtracted per decode step. After a retraction the ratio jumps to 1.0.
        speculative: speculative decoding options; with an algorithm set, decode steps become TARGET_VERIFY steps
            where drafts exist (``raymoe.scheduler.spec_steps``; the driver then runs one step at a time).

    Raises:
        ValueError: the ratios are not ``0 <= min <= init <= 1``.

    Attributes:
        state: the group's :class:`GroupState`; ``waiting``, ``running``, ``chunked_req``, ``new_token_ratio``,
            ``num_retractions``, ``hit_tokens`` and ``num_running`` read it (read-only).
        token_allocator, req_allocator, tree_cache: the group's KV slot allocator, row allocator and radix cache.
        stop_rules: EOS ids and detokenizer (also as ``eos_token_ids`` and ``detokenize``).
        spec: the group's :class:`~raymoe.scheduler.spec_steps.SpecSteps` (its counters feed the metrics), or None.
    """

    MAX_INFLIGHT = MAX_INFLIGHT  # step N running and step N+1 formed (``raymoe.scheduler.batch_formation``)

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, *, eos_token_ids: Sequence[int],
                 detokenize: Callable[[Sequence[int]], str] | None = None, vocab_size: int | None = None,
                 init_new_token_ratio: float = 0.7, min_new_token_ratio: float = 0.1,
                 new_token_ratio_decay: float = 0.002, speculative: SpeculativeConfig | None = None):
        ratio = TokenRatioPolicy(init_new_token_ratio, min_new_token_ratio, new_token_ratio_decay)
        self.config = config
        self.cache_config = cache_config
        self.stop_rules = StopRules(frozenset(int(t) for t in eos_token_ids), detokenize)
        self.eos_token_ids, self.detokenize = self.stop_rules.eos_token_ids, self.stop_rules.detokenize
        self.state = GroupState(config, cache_config, ratio, self.stop_rules.eos_token_ids)
        self.token_allocator = self.state.token_allocator
        self.req_allocator = self.state.req_allocator
        self.tree_cache = self.state.tree_cache
        limits = RequestLimits(cache_config.max_context_len, vocab_size, self.token_allocator.size)
        self._intake = RequestIntake(self.state, limits, has_detokenizer=detokenize is not None)
        self.spec = SpecSteps(self.state, speculative) if speculative is not None and speculative.enabled else None
        self._formation = BatchFormation(self.state, self.spec)

    # ---------------------------------------------------------------------------------------------- requests
    def add_request(self, req: Req) -> None:
        """Queue a new request.

        Raises:
            InvalidRequestError: ``"prompt"`` when it is empty, holds an id outside the vocabulary, leaves no room
                for one output token within ``max_context_len``, or is longer than the whole KV pool
                (``raymoe.scheduler.request_rules``); ``"logprobs"`` past the vocabulary size; ``"stop"`` when it
                has stop strings and the scheduler has no detokenizer; ``"rid"`` when a request with that id is
                unfinished; ``"queue"`` when ``max_queued_requests`` requests are already waiting.
        """
        self._intake.add(req)

    def abort_request(self, rid: str) -> Req | None:
        """Remove an unfinished request wherever it is, release its KV and radix lock, finish it with ABORT.

        A request that is part of the batch in flight is skipped by ``process_batch_result``.

        Returns:
            the aborted request, or ``None`` when ``rid`` is unknown or already finished.
        """
        return self._intake.abort(rid)

    def fail_request(self, req: Req, fault: RequestFault, *, report: bool = True) -> None:
        """Fail one unfinished request (``FinishKind.ERROR`` with ``fault``) wherever it is and release its KV,
        row and radix lock; with ``report`` it is returned once by :meth:`drain_finished` (else the caller
        reports it). The other requests are untouched."""
        self.state.fail(req, fault, report=report)

    def fail_inflight(self, fault: RequestFault) -> list[Req]:
        """The steps in flight failed on the ranks: fail their unfinished requests with ``fault``, forget the
        batches and drop the evictable radix cache (see :meth:`RequestIntake.fail_inflight`). Returns the failed
        requests."""
        return self._intake.fail_inflight(fault)

    def has_unfinished(self) -> bool:
        """Whether any accepted request has not finished yet."""
        return bool(self.state.unfinished)

    def drain_finished(self) -> list[Req]:
        """Requests finished while scheduling, not by a step (LENGTH: the last running request found no KV slot;
        or failed because their row could not be built).

        The KV accounting makes the first unreachable in normal operation; it is the fallback that keeps the
        scheduler from hanging if it ever happens. The driver reports them like finished requests of a step (call
        it after ``get_next_batch_to_run``, also when that returns ``None``); each is returned once.
        """
        return self._intake.drain()

    # ------------------------------------------------------------------------------------------------ steps
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Form the next step (see ``raymoe.scheduler.batch_formation``); ``None`` when there is nothing to run.
        KV slots for the step are allocated here, and the batch is recorded as in flight.

        Raises:
            RuntimeError: ``MAX_INFLIGHT`` batches are in flight already (process the oldest result first).
        """
        return self._formation.next_batch()

    def process_batch_result(self, batch: ScheduleBatch, output: StepOutput) -> list[Req]:
        """Apply one step's sampled tokens (see :func:`raymoe.scheduler.results.apply_batch_result`).

        Returns:
            the requests that got a new token (finished or not), in batch order.

        Raises:
            ValueError: ``batch`` is not the oldest batch in flight, or ``output`` has the wrong number of rows
                (nothing is changed then).
        """
        if self.spec is None:
            return apply_batch_result(self.state, batch, output, self.stop_rules)
        check_oldest(self.state, batch)  # before the speculative bookkeeping below changes anything
        self.spec.observe_step(batch, output)
        self.spec.release_scratch(batch)
        if batch.drafts is not None:
            out = apply_verify_result(self.state, batch, output, self.stop_rules, self.spec)
        else:
            out = apply_batch_result(self.state, batch, output, self.stop_rules)
        self.spec.store_drafts(batch, output)
        return out

    # ------------------------------------------------------------------------------------------ observability
    waiting = _state_view("waiting", "Requests waiting for (re-)prefill, in order of acceptance (``list[Req]``).")
    running = _state_view("running", "Requests whose prompt is fully scheduled, in admission order (``list[Req]``).")
    chunked_req = _state_view("chunked_req", "The request being prefilled chunk by chunk (``Req | None``).")
    new_token_ratio = _state_view("new_token_ratio", "Fraction of remaining ``max_tokens`` admission reserves.")
    num_retractions = _state_view("num_retractions", "Requests pushed back to ``waiting`` by KV exhaustion so far.")
    hit_tokens = _state_view("hit_tokens", "Prompt tokens served from the radix cache at admission so far.")
    num_running = _state_view("num_running", "Requests holding KV (decoding, or being prefilled chunk by chunk).")

    @property
    def num_waiting(self) -> int:
        return len(self.state.waiting)

    @property
    def req_pool_size(self) -> int:
        """ReqToTokenPool rows the ranks must allocate (row indices are ``0 .. req_pool_size - 1``)."""
        return self.req_allocator.size

    def kv_usage(self) -> float:
        """Fraction of KV slots holding tokens of requests or locked prefixes (see
        :func:`raymoe.scheduler.accounting.kv_usage`)."""
        return accounting.kv_usage(self.state)

    def flush_cache(self) -> None:
        """Drop every prefix the radix cache holds and free its slots (SGLang's ``flush_cache``): after a weight
        update, KV computed with the old weights must not be reused. Only while the group is idle.

        Raises:
            RuntimeError: a request is unfinished, a batch in flight, or KV held for the other engine of a PD pair.
        """
        s = self.state
        if s.unfinished or s.inflight or s.kv_reservations or s.kv_exports:
            raise RuntimeError(f"flush_cache needs an idle group: {len(s.unfinished)} unfinished request(s), "
                               f"{len(s.inflight)} batch(es) in flight, {len(s.kv_reservations) + len(s.kv_exports)} "
                               "KV reservation(s) or export(s)")
        s.tree_cache.reset()

    def idle_report(self) -> IdleReport | None:
        """The idle invariant's counts when this group holds no unfinished request and no batch is in flight
        (``None`` otherwise). O(1). See :func:`raymoe.scheduler.accounting.idle_report`."""
        return accounting.idle_report(self.state)

    def check_memory_invariants(self) -> None:
        """Assert that every KV slot and row is accounted for exactly once (tests and debugging); see
        :func:`raymoe.scheduler.accounting.check_memory_invariants`."""
        accounting.check_memory_invariants(self.state)
