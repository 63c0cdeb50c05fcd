"""Forming the next step of one DP group: prefill admission, MIXED steps, decode steps, their KV slots.

Ownership: part of the group's ``Scheduler``; works on its :class:`~raymoe.scheduler.group_state.GroupState` and
records each batch it forms as in flight there. Step policy (SGLang's): prefill first (continue the chunked
request, then admit new ones in policy order through a ``PrefillAdder``); otherwise decode every running request.
With ``enable_mixed_chunk`` a prefill step also carries one decode row of every running request
(``ForwardMode.MIXED``), so arrivals never stall the running streams; the decode rows take their share of the step's
token budget. A running request whose pending token will end it by length is not scheduled again. Decode needs one
new slot per request; ``raymoe.scheduler.retraction`` frees it when the pool is short (and names the requests that
decode, so they are listed once per step); ``raymoe.scheduler.decode_rows`` builds the DECODE batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from raymoe.scheduler.decode_rows import DecodeRows
from raymoe.scheduler.group_state import GroupState
from raymoe.scheduler.policy import order_waiting
from raymoe.scheduler.prefill_adder import AddResult, PrefillAdder, decode_reservation
from raymoe.scheduler.req import Req, RequestFaultError
from raymoe.scheduler.retraction import make_room_for_decode
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.scheduler.spec_steps import SpecSteps
from raymoe.step.forward_mode import ForwardMode

# Most batches in flight at once: step N running and step N+1 formed (overlap scheduling).
MAX_INFLIGHT = 2


class BatchFormation:
    """Chooses and builds each step's batch of one group, allocating its KV slots.

    Args:
        state: the group's state.
        spec: the group's speculative steps (``raymoe.scheduler.spec_steps``): a decode step becomes a
            TARGET_VERIFY step where drafts exist; None: off.
    """

    def __init__(self, state: GroupState, spec: SpecSteps | None = None):
        self.state = state
        self._spec = spec
        self._admissions = itertools.count()
        self._decode_rows = DecodeRows(state)

    def next_batch(self) -> ScheduleBatch | None:
        """Form the next step: a prefill batch if anything can be admitted (MIXED with the running decodes when
        ``enable_mixed_chunk``), else a decode batch of the running requests; ``None`` when there is nothing to
        run. KV slots for the step are allocated here, and the batch is recorded as in flight.

        Raises:
            RuntimeError: ``MAX_INFLIGHT`` batches are in flight already (apply the oldest result first).
        """
        s = self.state
        if len(s.inflight) >= MAX_INFLIGHT:
            raise RuntimeError("process_batch_result must be called for the oldest batch in flight first")
        batch = None
        if s.config.enable_mixed_chunk and (s.waiting or s.chunked_req is not None):
            batch = self._mixed_batch()
        if batch is None:
            batch = self._prefill_batch()
        if batch is None:
            batch = self._decode_batch()
            if batch is None and (s.waiting or s.chunked_req is not None):
                batch = self._prefill_batch()  # decode may have freed KV by finishing its last request
            if batch is None and s.waiting and not s.running and s.chunked_req is None \
                    and not s.inflight and s.tree_cache.evictable_size() > 0:
                # Idle pool, and still nothing fits: with pages, cached tokens also strand the free slots of
                # their pages, which the admission check cannot count. Evicting the whole cache frees every page.
                s.tree_cache.evict(s.tree_cache.evictable_size())
                batch = self._prefill_batch()
        if batch is not None:
            if self._spec is not None and self._spec.ranks_draft:
                batch = self._spec.attach_draft_inputs(batch)
            batch.mark_scheduled()
            s.inflight.append(batch)
        return batch

    def _build(self, reqs: list[Req], mode: ForwardMode, extend_lens: list[int],
               drafts: list[list[int]] | None = None) -> ScheduleBatch | None:
        """``ScheduleBatch.build`` that fails (only) the requests whose rows cannot be built and builds the
        step from the others; ``None`` when none is left."""
        reqs, extend_lens = list(reqs), list(extend_lens)
        drafts = None if drafts is None else list(drafts)
        while reqs:
            try:
                return ScheduleBatch.build(reqs, mode, extend_lens, drafts)
            except RequestFaultError as e:
                i = next(i for i, r in enumerate(reqs) if r is e.req)
                del reqs[i], extend_lens[i]
                if drafts is not None:
                    del drafts[i]
                self.state.fail(e.req, e.fault)
        return None

    def _running_reservation(self) -> int:
        """KV slots held back for the future decode tokens of running requests (scaled by the ratio)."""
        s = self.state
        ratio, ctx = s.new_token_ratio, s.max_seq_len
        return sum(decode_reservation(r, r.kv_len, ratio, ctx) for r in s.running)

    def _prefill_batch(self, decoders: Sequence[Req] = (),
                       drafts: list[list[int]] | None = None) -> ScheduleBatch | None:
        """Admit prompts (and continue the chunked one) into an EXTEND batch; with ``decoders`` (their decode
        slots, and their ``drafts``' slots with speculation, already allocated) a MIXED batch whose decode rows use
        their tokens of the budgets. ``None`` when no prompt token is admitted."""
        s = self.state
        if not s.waiting and s.chunked_req is None:
            return None
        chunked = s.chunked_req
        live = len(s.running) + (chunked is not None)
        n_dec = len(decoders) + (sum(map(len, drafts)) if drafts else 0)
        chunk = s.config.chunked_prefill_size
        adder = PrefillAdder(
            tree=s.tree_cache, token_allocator=s.token_allocator, req_allocator=s.req_allocator,
            max_prefill_tokens=s.config.max_prefill_tokens - n_dec,
            chunked_prefill_size=None if chunk is None else chunk - n_dec,
            max_new_reqs=min(s.config.max_running_requests - live, s.req_allocator.available_size()),
            reserved_tokens=self._running_reservation(),  # the chunked request books its own rest
            new_token_ratio=s.new_token_ratio, max_context_len=s.max_seq_len,
            pool_idle=live == 0, hit_cut=self._spec.hit_cut if self._spec is not None else 0,
        )
        result = AddResult.CONTINUE
        if chunked is not None:
            result = adder.add_chunked_req(chunked)
        if result == AddResult.CONTINUE:
            for req in order_waiting(s.waiting, s.config.schedule_policy, s.tree_cache):
                if req.pending_ids:  # retracted while a step in flight samples its next token: wait for it
                    continue
                if adder.add_one_req(req) != AddResult.CONTINUE:
                    break
        s.chunked_req = adder.new_chunked_req
        if not adder.reqs:
            return None
        admitted = set(map(id, adder.reqs))
        s.waiting = [r for r in s.waiting if id(r) not in admitted]
        for req in adder.reqs:
            if req is not chunked:
                req.admit_seq = next(self._admissions)
                s.hit_tokens += req.prefix_len
                req.limits = s.limits_for(req)
            if req is not s.chunked_req:
                s.running.append(req)
        if decoders and drafts is not None:  # decode rows that verify their drafts (raymoe.scheduler.spec_steps)
            return self._build(adder.reqs + list(decoders), ForwardMode.MIXED,
                               adder.extend_lens + [1 + len(d) for d in drafts], [[]] * len(adder.reqs) + drafts)
        if decoders:
            return self._build(adder.reqs + list(decoders), ForwardMode.MIXED, adder.extend_lens + [1] * n_dec)
        return self._build(adder.reqs, ForwardMode.EXTEND, adder.extend_lens)

    def _alloc_decode_slots(self, decoders: list[Req]) -> None:
        s = self.state
        slots = s.token_allocator.alloc_decode(s.last_slots(decoders))
        assert slots is not None, "decode room was checked"
        for req, slot in zip(decoders, slots, strict=True):
            req.kv_slots.append(slot)
        s.new_token_ratio = max(s.ratio.floor, s.new_token_ratio - s.ratio.decay)

    def _mixed_batch(self) -> ScheduleBatch | None:
        """A MIXED batch: admitted prompt chunks plus one decode row per running request. ``None`` (nothing
        allocated) when nothing decodes, when the decodes alone fill the step's token budget, or when they would
        need a retraction first; a DECODE batch when no prompt token can be admitted."""
        s = self.state
        decoders = s.decoders()
        chunk = s.config.chunked_prefill_size
        budget = s.config.max_prefill_tokens if chunk is None else min(chunk, s.config.max_prefill_tokens)
        if not decoders or len(decoders) >= budget:  # no room left for a prompt token: prefill alone first
            return None
        alloc = s.token_allocator
        cost = alloc.decode_cost(s.last_slots(decoders))
        short = cost - alloc.available_size()
        if short > 0:
            if s.tree_cache.evictable_size() < short:
                return None
            s.tree_cache.evict(short)
            if cost > alloc.available_size():
                return None  # pages: the evicted tokens did not free whole pages
        self._alloc_decode_slots(decoders)
        drafts = self._spec.step_drafts(decoders) if self._spec is not None else None
        if drafts is not None:
            self._spec.alloc_draft_slots(decoders, drafts)
        batch = self._prefill_batch(decoders, drafts)
        if batch is None:
            if drafts is not None:
                return self._build(decoders, ForwardMode.TARGET_VERIFY, [1 + len(d) for d in drafts], drafts)
            return self._build_decode(decoders)
        return batch

    def _decode_batch(self) -> ScheduleBatch | None:
        s = self.state
        if not s.running:
            return None
        decoders = make_room_for_decode(s)
        if not decoders:
            return None
        if self._spec is not None:
            batch = self._spec.verify_batch(decoders, self._alloc_decode_slots)
            if batch is not None:
                return batch
        self._alloc_decode_slots(decoders)
        return self._build_decode(decoders)

    def _build_decode(self, decoders: list[Req]) -> ScheduleBatch | None:
        """The DECODE batch of ``decoders`` (their slots allocated): ``DecodeRows`` where it can, else ``_build``."""
        batch = self._decode_rows.build(decoders)
        return batch if batch is not None else self._build(decoders, ForwardMode.DECODE, [1] * len(decoders))
