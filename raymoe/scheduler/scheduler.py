"""Per-DP-group scheduler (driver side, plain Python; never touches model tensors).

Ownership: the Driver owns one ``Scheduler`` per DP-attention group. The scheduler owns that group's
``TokenSlotAllocator`` (KV slots), ``ReqSlotAllocator`` (ReqToTokenPool rows), ``RadixCache`` and every accepted
``Req``. Each step the driver calls :meth:`Scheduler.get_next_batch_to_run`, ships
``batch.worker_batch`` to the ranks, and hands their ``StepOutput`` to
:meth:`Scheduler.process_batch_result`. At most two batches may be in flight (overlap scheduling: step N+1 is
formed while step N runs, its rows read step N's tokens through placeholders, see ``raymoe.scheduler.req``);
results are processed oldest first.

Request life cycle: ``waiting`` -> admitted by the ``PrefillAdder`` (a long prompt stays ``chunked_req`` until its
last chunk is scheduled) -> ``running`` (decodes one token per step) -> finished, or retracted back to
``waiting`` when decode runs out of KV (it later re-prefills ``origin_input_ids + output_ids`` and continues).

Step policy (SGLang's): prefill first (continue the chunked request, then admit new ones in policy order);
otherwise decode every running request. With ``enable_mixed_chunk`` a prefill step also carries one decode row of
every running request (``ForwardMode.MIXED``), so arrivals never stall the running streams; the decode rows take
their share of the step's token budget. A running request whose pending token will end it by length is not
scheduled again. Decode needs one new slot per request; when the pool is short the
scheduler evicts cached prefixes, then retracts the latest admitted requests, then the chunked request. A request
whose next decode step would need more KV than the whole pool finishes with LENGTH in ``process_batch_result``,
so the last running request can always decode; finishing it for lack of KV is only a defensive fallback (such
requests are returned by :meth:`Scheduler.drain_finished`, which the driver should poll every step).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence

from raymoe.config import CacheConfig, SchedulerConfig
from raymoe.errors import InvalidRequestError
from raymoe.kvcache.allocator import ReqSlotAllocator
from raymoe.kvcache.paged_allocator import make_token_allocator
from raymoe.kvcache.radix_cache import RadixCache
from raymoe.scheduler.accounting import IdleReport, check_memory_invariants, idle_report
from raymoe.scheduler.policy import order_waiting
from raymoe.scheduler.prefill_adder import AddResult, PrefillAdder, decode_reservation
from raymoe.scheduler.req import FinishKind, Req, RequestFault, RequestFaultError
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_output import StepOutput

__all__ = ["IdleReport", "Scheduler"]

log = logging.getLogger(__name__)


class Scheduler:
    """Waiting queue, running set, KV accounting and batch formation of one DP-attention group.

    Args:
        config: scheduling limits.
        cache_config: KV pool size (``max_total_tokens`` slots), ``max_context_len``, radix cache on/off.
        eos_token_ids: the model's end-of-sequence token ids.
        detokenize: token ids -> text; required for requests with stop strings.
        init_new_token_ratio: fraction of a request's remaining ``max_tokens`` reserved in KV when admitting
            new requests (lower admits more and risks retraction); decays per decode step.
        min_new_token_ratio: floor of that fraction.
        new_token_ratio_decay: amount subtracted per decode step. After a retraction the ratio jumps to 1.0.

    Raises:
        ValueError: the ratios are not ``0 <= min <= init <= 1``.

    Attributes:
        token_allocator, req_allocator, tree_cache: the group's KV slot allocator, row allocator and radix cache.
        waiting: requests waiting for (re-)prefill, in arrival order of acceptance.
        running: requests whose prompt is fully scheduled (they decode), in admission order.
        chunked_req: the request whose prompt is being prefilled chunk by chunk, or ``None``.
        num_retractions: requests pushed back to ``waiting`` by KV exhaustion so far.
        hit_tokens: prompt tokens served from the radix cache at admission so far.
    """

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, *, eos_token_ids: Sequence[int],
                 detokenize: Callable[[Sequence[int]], str] | None = None, init_new_token_ratio: float = 0.7,
                 min_new_token_ratio: float = 0.1, new_token_ratio_decay: float = 0.002):
        if not 0.0 <= min_new_token_ratio <= init_new_token_ratio <= 1.0:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        self.config = config
        self.cache_config = cache_config
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.detokenize = detokenize
        # Token-granular, or pages of cache_config.page_tokens for block-table kernels (raymoe.kvcache.paged_allocator).
        self.token_allocator = make_token_allocator(cache_config.max_total_tokens, cache_config.page_tokens)
        # Sized like the ranks' table (config.req_pool_rows); the scheduler itself keeps running + chunked
        # requests within max_running_requests, so the last row is spare.
        self.req_allocator = ReqSlotAllocator(config.req_pool_rows)
        self.tree_cache = RadixCache(self.token_allocator, disable=not cache_config.enable_radix_cache)
        # Longest sequence a request can reach: the context, and the pool (its KV must fit in it).
        self._max_seq_len = min(cache_config.max_context_len, cache_config.max_total_tokens + 1)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = init_new_token_ratio
        self.min_new_token_ratio = min_new_token_ratio
        self.new_token_ratio_decay = new_token_ratio_decay
        self.num_retractions = 0
        self.hit_tokens = 0
        self._unfinished: dict[str, Req] = {}
        self._inflight: deque[ScheduleBatch] = deque()  # oldest first
        self._finished_outside_step: list[Req] = []
        self._arrivals = itertools.count()
        self._admissions = itertools.count()

    # ---------------------------------------------------------------------------------------------- requests
    def add_request(self, req: Req) -> None:
        """Queue a new request.

        Raises:
            InvalidRequestError: ``"prompt"`` when it is empty, leaves no room for one output token within
                ``max_context_len``, or is longer than the whole KV pool; ``"stop"`` when it has stop strings and
                the scheduler has no detokenizer; ``"rid"`` when a request with that id is unfinished;
                ``"queue"`` when ``max_queued_requests`` requests are already waiting.
        """
        n = len(req.origin_input_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if n >= self.cache_config.max_context_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {n} tokens; max_context_len {self.cache_config.max_context_len} leaves "
                "no room for an output token")
        if n > self.token_allocator.size:
            raise InvalidRequestError(
                "prompt", f"the prompt has {n} tokens, more than the KV pool ({self.token_allocator.size} tokens)")
        if req.sampling_params.stop and self.detokenize is None:
            raise InvalidRequestError("stop", "stop strings need a detokenizer, and this scheduler has none")
        if req.rid in self._unfinished:
            raise InvalidRequestError("rid", f"a request with id {req.rid!r} is already in progress")
        if req.finished or req.output_ids or req.kv_slots:
            raise InvalidRequestError("rid", f"request {req.rid!r} was already scheduled")
        if len(self.waiting) >= self.config.max_queued_requests:
            raise InvalidRequestError("queue", f"{len(self.waiting)} requests are already waiting")
        req.arrival = next(self._arrivals)
        self.waiting.append(req)
        self._unfinished[req.rid] = req

    def abort_request(self, rid: str) -> Req | None:
        """Remove an unfinished request wherever it is, release its KV and radix lock, finish it with ABORT.

        A request that is part of the batch in flight is skipped by ``process_batch_result``.

        Returns:
            the aborted request, or ``None`` when ``rid`` is unknown or already finished.
        """
        req = self._unfinished.get(rid)
        if req is None:
            return None
        self._detach(req)
        req.finish(FinishKind.ABORT, message="aborted")
        return req

    def _detach(self, req: Req) -> None:
        """Take an unfinished request out of every queue and release its KV, row and radix lock (not cached)."""
        del self._unfinished[req.rid]
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        self._release(req, cache=False)

    def fail_request(self, req: Req, fault: RequestFault, *, report: bool = True) -> None:
        """Fail one unfinished request (``FinishKind.ERROR`` with ``fault``) wherever it is and release its KV,
        row and radix lock; with ``report`` it is returned once by :meth:`drain_finished` (else the caller
        reports it). The other requests are untouched."""
        if req.rid not in self._unfinished:
            return
        self._detach(req)
        req.fail(fault)
        if report:
            self._finished_outside_step.append(req)
        log.warning("request %s failed: %s", req.rid, fault.message)

    def fail_inflight(self, fault: RequestFault) -> list[Req]:
        """The steps in flight failed on the ranks: fail each of their unfinished requests with ``fault`` (their
        KV is released, nothing is cached) and forget the batches. Cached prefixes are dropped too (with overlap
        scheduling a finished request may have cached a slot that only the failed step would have written).
        Returns the failed requests."""
        batches, self._inflight = list(self._inflight), deque()
        failed = list({id(r): r for b in batches for r in b.reqs if not r.finished}.values())  # each request once
        for req in failed:
            self.fail_request(req, fault, report=False)
        if batches:
            self.tree_cache.evict(self.tree_cache.evictable_size())
        return failed

    def has_unfinished(self) -> bool:
        """Whether any accepted request has not finished yet."""
        return bool(self._unfinished)

    def drain_finished(self) -> list[Req]:
        """Requests finished while scheduling, not by a step (LENGTH: the last running request found no KV slot).

        The KV accounting makes this unreachable in normal operation; it is the fallback that keeps the scheduler
        from hanging if it ever happens. The driver reports them like finished requests of a step (call it after
        ``get_next_batch_to_run``, also when that returns ``None``); each is returned once.
        """
        out, self._finished_outside_step = self._finished_outside_step, []
        return out

    # ------------------------------------------------------------------------------------------------ steps
    # Most batches in flight at once: step N running and step N+1 formed (overlap scheduling).
    MAX_INFLIGHT = 2

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Form the next step: a prefill batch if anything can be admitted (MIXED with the running decodes when
        ``enable_mixed_chunk``), else a decode batch of the running requests; ``None`` when there is nothing to
        run. KV slots for the step are allocated here, and the batch is recorded as in flight.

        Raises:
            RuntimeError: ``MAX_INFLIGHT`` batches are in flight already (process the oldest result first).
        """
        if len(self._inflight) >= self.MAX_INFLIGHT:
            raise RuntimeError("process_batch_result must be called for the oldest batch in flight first")
        batch = None
        if self.config.enable_mixed_chunk and (self.waiting or self.chunked_req is not None):
            batch = self._get_mixed_batch()
        if batch is None:
            batch = self._get_prefill_batch()
        if batch is None:
            batch = self._get_decode_batch()
            if batch is None and (self.waiting or self.chunked_req is not None):
                batch = self._get_prefill_batch()  # decode may have freed KV by finishing its last request
            if batch is None and self.waiting and not self.running and self.chunked_req is None \
                    and not self._inflight and self.tree_cache.evictable_size() > 0:
                # Idle pool, and still nothing fits: with pages, cached tokens also strand the free slots of
                # their pages, which the admission check cannot count. Evicting the whole cache frees every page.
                self.tree_cache.evict(self.tree_cache.evictable_size())
                batch = self._get_prefill_batch()
        if batch is not None:
            batch.mark_scheduled()
            self._inflight.append(batch)
        return batch

    def _build(self, reqs: list[Req], mode: ForwardMode, extend_lens: list[int]) -> ScheduleBatch | None:
        """``ScheduleBatch.build`` that fails (only) the requests whose rows cannot be built and builds the
        step from the others; ``None`` when none is left."""
        reqs, extend_lens = list(reqs), list(extend_lens)
        while reqs:
            try:
                return ScheduleBatch.build(reqs, mode, extend_lens)
            except RequestFaultError as e:
                i = next(i for i, r in enumerate(reqs) if r is e.req)
                del reqs[i], extend_lens[i]
                self.fail_request(e.req, e.fault)
        return None

    def _running_reservation(self) -> int:
        """KV slots held back for the future decode tokens of running requests (scaled by the ratio)."""
        ratio, ctx = self.new_token_ratio, self._max_seq_len
        return sum(decode_reservation(r, r.kv_len, ratio, ctx) for r in self.running)

    def _get_prefill_batch(self, decoders: Sequence[Req] = ()) -> ScheduleBatch | None:
        """Admit prompts (and continue the chunked one) into an EXTEND batch; with ``decoders`` (their decode
        slots already allocated) a MIXED batch whose decode rows use ``len(decoders)`` tokens of the budgets.
        ``None`` when no prompt token is admitted."""
        if not self.waiting and self.chunked_req is None:
            return None
        chunked = self.chunked_req
        live = len(self.running) + (chunked is not None)
        n_dec = len(decoders)
        chunk = self.config.chunked_prefill_size
        adder = PrefillAdder(
            tree=self.tree_cache, token_allocator=self.token_allocator, req_allocator=self.req_allocator,
            max_prefill_tokens=self.config.max_prefill_tokens - n_dec,
            chunked_prefill_size=None if chunk is None else chunk - n_dec,
            max_new_reqs=min(self.config.max_running_requests - live, self.req_allocator.available_size()),
            reserved_tokens=self._running_reservation(),  # the chunked request books its own rest
            new_token_ratio=self.new_token_ratio, max_context_len=self._max_seq_len,
            pool_idle=live == 0,
        )
        result = AddResult.CONTINUE
        if chunked is not None:
            result = adder.add_chunked_req(chunked)
        if result == AddResult.CONTINUE:
            for req in order_waiting(self.waiting, self.config.schedule_policy, self.tree_cache):
                if req.pending_ids:  # retracted while a step in flight samples its next token: wait for it
                    continue
                if adder.add_one_req(req) != AddResult.CONTINUE:
                    break
        self.chunked_req = adder.new_chunked_req
        if not adder.reqs:
            return None
        admitted = set(map(id, adder.reqs))
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        for req in adder.reqs:
            if req is not chunked:
                req.admit_seq = next(self._admissions)
                self.hit_tokens += req.prefix_len
            if req is not self.chunked_req:
                self.running.append(req)
        if decoders:
            return self._build(adder.reqs + list(decoders), ForwardMode.MIXED, adder.extend_lens + [1] * n_dec)
        return self._build(adder.reqs, ForwardMode.EXTEND, adder.extend_lens)

    def _decoders(self) -> list[Req]:
        """Running requests to decode this step: all but those whose pending token ends them by length."""
        ctx, pool = self.cache_config.max_context_len, self.token_allocator.size
        return [r for r in self.running if not r.length_capped(ctx, pool)]

    def _alloc_decode_slots(self, decoders: list[Req]) -> None:
        slots = self.token_allocator.alloc_decode([r.kv_slots[-1] for r in decoders])
        assert slots is not None, "decode room was checked"
        for req, slot in zip(decoders, slots, strict=True):
            req.kv_slots.append(slot)
        self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - self.new_token_ratio_decay)

    def _get_mixed_batch(self) -> ScheduleBatch | None:
        """A MIXED batch: admitted prompt chunks plus one decode row per running request. ``None`` (nothing
        allocated) when nothing decodes, when the decodes alone fill the step's token budget, or when they would
        need a retraction first; a DECODE batch when no prompt token can be admitted."""
        decoders = self._decoders()
        chunk = self.config.chunked_prefill_size
        budget = self.config.max_prefill_tokens if chunk is None else min(chunk, self.config.max_prefill_tokens)
        if not decoders or len(decoders) >= budget:  # no room left for a prompt token: prefill alone first
            return None
        alloc = self.token_allocator
        cost = alloc.decode_cost([r.kv_slots[-1] for r in decoders])
        short = cost - alloc.available_size()
        if short > 0:
            if self.tree_cache.evictable_size() < short:
                return None
            self.tree_cache.evict(short)
            if cost > alloc.available_size():
                return None  # pages: the evicted tokens did not free whole pages
        self._alloc_decode_slots(decoders)
        batch = self._get_prefill_batch(decoders)
        if batch is None:
            return self._build(decoders, ForwardMode.DECODE, [1] * len(decoders))
        return batch

    def _get_decode_batch(self) -> ScheduleBatch | None:
        if not self.running:
            return None
        self._make_room_for_decode()
        decoders = self._decoders()
        if not decoders:
            return None
        self._alloc_decode_slots(decoders)
        return self._build(decoders, ForwardMode.DECODE, [1] * len(decoders))

    def _make_room_for_decode(self) -> None:
        """Free KV until every running request can take one more slot (evict, retract, or finish the last)."""
        while self.running:
            need = self.token_allocator.decode_cost([r.kv_slots[-1] for r in self._decoders()])
            short = need - self.token_allocator.available_size()
            if short <= 0:
                return
            if self.tree_cache.evictable_size() > 0 and self.tree_cache.evict(short) > 0:
                continue
            if len(self.running) > 1:
                victim = max(self.running, key=lambda r: r.admit_seq)  # latest admitted: least work lost
                self.running.remove(victim)
                self._retract(victim)
            elif self.chunked_req is not None:
                victim, self.chunked_req = self.chunked_req, None
                self._retract(victim)
            else:
                last = self.running.pop()
                last.finish(FinishKind.LENGTH, message="KV cache exhausted")
                self._unfinished.pop(last.rid, None)
                self._release(last, cache=True)
                self._finished_outside_step.append(last)

    def _retract(self, req: Req) -> None:
        """Push ``req`` back to the waiting queue, freeing its KV (its output so far is kept)."""
        self._release(req, cache=False)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.append(req)
        self.new_token_ratio = 1.0

    def process_batch_result(self, batch: ScheduleBatch, output: StepOutput) -> list[Req]:
        """Apply one step's sampled tokens.

        Replaces each row's placeholder with its token (except for a non-final prefill chunk, whose token is
        discarded), checks the stop conditions, and for finished requests caches their KV in the radix cache and
        frees their slots, row and lock. Rows of requests that finished or were aborted while the batch was in
        flight are skipped (with overlap scheduling a request finished by step N may have a row in step N+1).
        A request whose own post-processing raises (its stop-string check, say) fails alone
        (``FinishKind.ERROR``, kind ``"failed"``, its KV released) and is returned with the others.

        Returns:
            the requests that got a new token (finished or not), in batch order.

        Raises:
            ValueError: ``batch`` is not the oldest batch in flight, or ``output`` has the wrong number of rows
                (nothing is changed then).
        """
        if not self._inflight or batch is not self._inflight[0]:
            raise ValueError("process_batch_result: this batch is not the oldest one in flight")
        if len(output.next_token_ids) != batch.batch_size:  # StepOutput itself checks logprobs against its tokens
            raise ValueError(f"StepOutput has {len(output.next_token_ids)} tokens for {batch.batch_size} requests")
        self._inflight.popleft()
        logprobs = output.logprobs or [None] * batch.batch_size
        out: list[Req] = []
        rows = zip(batch.reqs, batch.partial, output.next_token_ids, logprobs, strict=True)
        for req, partial, token, lp in rows:
            if req.finished or partial:
                continue
            try:
                req.pending_ids.pop(0)
                req.append_token(token, lp)
                finished = req.check_finished(self.eos_token_ids, self.detokenize,
                                              self.cache_config.max_context_len,
                                              kv_pool_size=self.token_allocator.size)
            except Exception as e:  # noqa: BLE001 - this request's own check failed: fail it, keep the others
                log.exception("post-processing request %s failed", req.rid)
                self.fail_request(req, RequestFault("failed", f"checking the request's stop conditions failed "
                                                              f"({type(e).__name__})"), report=False)
                out.append(req)
                continue
            if finished:
                self._unfinished.pop(req.rid, None)
                if req in self.running:
                    self.running.remove(req)
                    self._release(req, cache=True)
                else:  # retracted while this batch was in flight: it holds no KV
                    self.waiting.remove(req)
            out.append(req)
        return out

    def _release(self, req: Req, *, cache: bool) -> None:
        """Give back the KV, radix lock and row of ``req`` (``cache``: insert its computed KV into the tree)."""
        if req.req_pool_idx is None:
            return
        slots = req.kv_slots
        if cache:
            fill = req.fill_ids
            k = min(len(slots), len(fill))  # slots past the real tokens (a step in flight) are not cached
            n = self.tree_cache.insert(fill[:k], slots[:k])
            if n > req.prefix_len:
                self.token_allocator.free(slots[req.prefix_len : n])
            if len(slots) > k:
                self.token_allocator.free(slots[k:])
        elif len(slots) > req.prefix_len:
            self.token_allocator.free(slots[req.prefix_len :])
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.req_allocator.free(req.req_pool_idx)
        req.reset_kv()

    # ------------------------------------------------------------------------------------------ observability
    @property
    def num_running(self) -> int:
        """Requests holding KV (decoding, or being prefilled chunk by chunk)."""
        return len(self.running) + (self.chunked_req is not None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def req_pool_size(self) -> int:
        """ReqToTokenPool rows the ranks must allocate (row indices are ``0 .. req_pool_size - 1``)."""
        return self.req_allocator.size

    def kv_usage(self) -> float:
        """Fraction of KV slots holding tokens of requests or locked prefixes (evictable cached tokens count as free,
        and so do a paged allocator's stranded slots, which hold no token)."""
        alloc = self.token_allocator
        used = alloc.size - alloc.available_size() - alloc.stranded_size() - self.tree_cache.evictable_size()
        return used / alloc.size

    def idle_report(self) -> IdleReport | None:
        """The idle invariant's counts when this group holds no unfinished request and no batch is in flight
        (``None`` otherwise). O(1). See :func:`raymoe.scheduler.accounting.idle_report`."""
        return idle_report(self)

    def check_memory_invariants(self) -> None:
        """Assert that every KV slot and row is accounted for exactly once (tests and debugging); see
        :func:`raymoe.scheduler.accounting.check_memory_invariants`."""
        check_memory_invariants(self)
