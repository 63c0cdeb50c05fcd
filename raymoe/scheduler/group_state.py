"""One DP group's scheduling state: its KV resources, request queues and counters, and how a request gives KV back.

Ownership: the group's ``Scheduler`` creates and owns one :class:`GroupState`; its components read and change it
(``intake``: accepting, aborting and failing requests; ``batch_formation``: forming steps; ``retraction``: freeing
KV for decode; ``results``: applying a step's tokens) and ``accounting`` audits it. None of them holds state of its
own beyond counters, so the group's whole picture is here. Plain Python, no tensors.

KV ownership of a request (``raymoe.scheduler.req``): the first ``prefix_len`` of its ``kv_slots`` belong to the
radix cache (locked through ``last_node``), the rest to the request; :meth:`GroupState.release` hands both back.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raymoe.config import CacheConfig, SchedulerConfig
from raymoe.kvcache.allocator import ReqSlotAllocator
from raymoe.kvcache.paged_allocator import make_token_allocator
from raymoe.kvcache.radix_cache import RadixCache
from raymoe.scheduler.req import Req, RequestFault
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.scheduler.stop_limits import StopLimits, stop_limits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVExport:
    """A finished prefill's prompt KV held for a decode engine (prefill/decode disaggregation).

    Attributes:
        node: the radix node locked for it (its path holds the prompt). slots: the prompt's slots as the request
            laid them out (``[prompt_len]`` slot indices: with a paged allocator, pages in position order, the last
            possibly partial, so they move page by page). held: the request's slots the radix cache did not take
            (it held those positions already), kept until the export is released so that ``slots`` stay valid.
        streamed: every prompt position went out in a step that wrote it to the decode engine layer by layer
            (``Req.kv_stream``); the decode side then only waits for the ranks' notification.
    """

    node: Any
    slots: list[int]
    held: list[int]
    streamed: bool = False


@dataclass(frozen=True)
class TokenRatioPolicy:
    """How much of a request's remaining ``max_tokens`` admission reserves in KV, as a fraction of those tokens.

    Attributes:
        init: the starting fraction (lower admits more and risks retraction).
        floor: the least fraction the decay reaches.
        decay: subtracted per decode step; after a retraction the fraction jumps to 1.0.

    Raises:
        ValueError: the fractions are not ``0 <= floor <= init <= 1``.
    """

    init: float = 0.7
    floor: float = 0.1
    decay: float = 0.002

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor <= self.init <= 1.0:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")


class GroupState:
    """KV resources, queues and counters of one DP-attention group.

    Args:
        config: scheduling limits. cache_config: KV pool size, context length, page size, radix cache on/off.
        ratio: the new-token ratio's start, floor and decay.
        eos_token_ids: the model's end-of-sequence ids (for :meth:`limits_for`).

    Attributes:
        config, cache_config: as given.
        token_allocator, req_allocator, tree_cache: the group's KV slot allocator, ReqToTokenPool row allocator and
            radix cache.
        max_seq_len: longest sequence a request can reach in tokens (the context, and the pool its KV must fit in).
        waiting: requests waiting for (re-)prefill, in order of acceptance.
        running: requests whose prompt is fully scheduled (they decode), in admission order.
        chunked_req: the request whose prompt is being prefilled chunk by chunk, or ``None``.
        unfinished: every accepted, unfinished request by id.
        inflight: batches sent to the ranks whose results are not applied yet, oldest first.
        finished_outside_step: requests finished or failed while scheduling, not yet reported (``drain``).
        new_token_ratio: the fraction admission reserves now (see :class:`TokenRatioPolicy`).
        num_retractions: requests pushed back to ``waiting`` by KV exhaustion so far.
        hit_tokens: prompt tokens served from the radix cache at admission so far.
        kv_epoch: grows by one each time a request gives its KV back (:meth:`release`); while it stays, every
            request that holds KV keeps its ReqToTokenPool row and sampling numbers (``raymoe.scheduler.decode_rows``
            relies on it).
    """

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, ratio: TokenRatioPolicy,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.cache_config = cache_config
        # Token-granular, or pages of cache_config.page_tokens for block-table kernels (raymoe.kvcache.paged_allocator).
        self.token_allocator = make_token_allocator(cache_config.max_total_tokens, cache_config.page_tokens)
        # Sized like the ranks' table (config.req_pool_rows); the scheduler itself keeps running + chunked
        # requests within max_running_requests, so the last row is spare.
        self.req_allocator = ReqSlotAllocator(config.req_pool_rows)
        self.tree_cache = RadixCache(self.token_allocator, disable=not cache_config.enable_radix_cache)
        self.max_seq_len = min(cache_config.max_context_len, cache_config.max_total_tokens + 1)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.unfinished: dict[str, Req] = {}
        self.inflight: deque[ScheduleBatch] = deque()
        self.finished_outside_step: list[Req] = []
        self.ratio = ratio
        self.new_token_ratio = ratio.init
        self.num_retractions = 0
        self.hit_tokens = 0
        self.kv_epoch = 0
        self.eos_token_ids = eos_token_ids
        self.kv_reservations: dict[str, list[int]] = {}
        self.kv_exports: dict[str, KVExport] = {}

    @property
    def num_running(self) -> int:
        """Requests holding KV (decoding, or being prefilled chunk by chunk)."""
        return len(self.running) + (self.chunked_req is not None)

    def limits_for(self, req: Req) -> StopLimits:
        """What ends ``req`` in this group (``raymoe.scheduler.stop_limits``; stored on it at admission)."""
        return stop_limits(len(req.origin_input_ids), req.sampling_params, self.eos_token_ids,
                           self.cache_config.max_context_len, self.token_allocator.size)

    def decoders(self) -> list[Req]:
        """Running requests to decode next: all but those whose pending token ends them by length
        (``Req.length_capped``, answered from ``Req.limits`` where it is set). O(running)."""
        ctx, pool = self.cache_config.max_context_len, self.token_allocator.size
        return [r for r in self.running
                if not (pend := r.pending_ids)
                or ((lim := r.limits) is not None and len(r.output_ids) + len(pend) < lim.output_cap)
                or (lim is None and not r.length_capped(ctx, pool))]

    def last_slots(self, reqs: list[Req]) -> list[int]:
        """The last KV slot of each of ``reqs``, as the allocator's ``decode_cost`` and ``alloc_decode`` take them.
        With one-token pages only their number matters, and zeros stand in for them (O(1) per request in C)."""
        if self.token_allocator.page_size == 1:
            return [0] * len(reqs)
        return [r.kv_slots[-1] for r in reqs]

    def release(self, req: Req, *, cache: bool) -> None:
        """Give back the KV, radix lock and row of ``req`` (``cache``: insert its computed KV into the tree)."""
        if req.req_pool_idx is None:
            return
        self.kv_epoch += 1
        slots = req.kv_slots
        duplicates: list[int] = []  # the request's slots for positions the tree held already
        if cache:
            fill = req.fill_ids
            k = min(len(slots), len(fill))  # slots past the real tokens (a step in flight) are not cached
            n = self.tree_cache.insert(fill[:k], slots[:k])
            duplicates = slots[req.prefix_len : n]
            if len(slots) > k:
                self.token_allocator.free(slots[k:])
        elif len(slots) > req.prefix_len:
            self.token_allocator.free(slots[req.prefix_len :])
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        exported = (cache and req.export_kv and req.finished and req.rid not in self.kv_exports
                    and self._export(req, slots, duplicates))
        if duplicates and not exported:
            self.token_allocator.free(duplicates)
        self.req_allocator.free(req.req_pool_idx)
        req.reset_kv()

    # ------------------------------------------------------------------ PD disaggregation (raymoe.actors.driver)
    def _export(self, req: Req, slots: list[int], duplicates: list[int]) -> bool:
        """Hold the prompt's KV, just cached, for a decode engine (``kv_exports``): lock its radix path and keep
        ``duplicates`` (the request's slots for positions the tree held already) so that the request's own
        layout ``slots[:prompt_len]`` stays valid. Returns False, holding nothing, when the cache does not hold the
        whole prompt (radix cache disabled)."""
        prompt = req.origin_input_ids
        m = self.tree_cache.match_prefix(prompt)
        if len(m.slots) != len(prompt) or len(slots) < len(prompt):
            return False
        self.tree_cache.inc_lock_ref(m.last_node)
        streamed = req.kv_stream is not None and req.kv_stream_sent >= len(prompt)
        self.kv_exports[req.rid] = KVExport(m.last_node, slots[: len(prompt)], duplicates, streamed)
        return True

    def release_export(self, rid: str) -> bool:
        """Unlock an exported prompt's KV (the decode engine has it, or gave up). Returns whether one was held."""
        held = self.kv_exports.pop(rid, None)
        if held is None:
            return False
        self.tree_cache.dec_lock_ref(held.node)
        if held.held:
            self.token_allocator.free(held.held)
        return True

    def reserve_kv(self, rid: str, num_tokens: int) -> list[int] | None:
        """Set aside ``num_tokens`` KV slots for a prompt's KV that a prefill engine will send (evicting unlocked
        cached prefixes if needed); None when the pool cannot hold them now.

        Raises:
            ValueError: ``rid`` holds a reservation already, or ``num_tokens < 1``.
        """
        if rid in self.kv_reservations or num_tokens < 1:
            raise ValueError(f"reserve_kv: {rid!r} already holds a reservation, or {num_tokens} < 1 tokens")
        slots = self.tree_cache.alloc_evicting(num_tokens)
        if slots is not None:
            self.kv_reservations[rid] = slots
        return slots

    def cancel_reservation(self, rid: str) -> bool:
        """Free a reservation whose KV will not come. Returns whether one was held."""
        slots = self.kv_reservations.pop(rid, None)
        if slots is None:
            return False
        self.token_allocator.free(slots)
        return True

    def cache_received(self, rid: str, prompt: Sequence[int]) -> int:
        """The reserved slots of ``rid`` now hold ``prompt``'s KV: hand them to the radix cache (a request with
        this prompt then finds it cached and computes only what follows). Returns the prompt tokens cached.

        Raises:
            KeyError: ``rid`` holds no reservation.
            ValueError: the reservation does not match the prompt's length.
        """
        slots = self.kv_reservations[rid]
        if len(slots) != len(prompt):
            raise ValueError(f"cache_received: {len(slots)} reserved slots for a prompt of {len(prompt)} tokens")
        del self.kv_reservations[rid]
        n = self.tree_cache.insert(list(prompt), slots)
        if n:  # the tree held the first n tokens already: ours are duplicates
            self.token_allocator.free(slots[:n])
        return len(prompt)

    def detach(self, req: Req) -> None:
        """Take an unfinished request out of every queue and release its KV, row and radix lock (not cached)."""
        del self.unfinished[req.rid]
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        self.release(req, cache=False)

    def fail(self, req: Req, fault: RequestFault, *, report: bool = True) -> None:
        """Fail one unfinished request (``FinishKind.ERROR`` with ``fault``) wherever it is and release its KV, row
        and radix lock; with ``report`` it joins ``finished_outside_step`` (else the caller reports it). A request
        that is not unfinished is left alone."""
        if req.rid not in self.unfinished:
            return
        self.detach(req)
        req.fail(fault)
        if report:
            self.finished_outside_step.append(req)
        log.warning("request %s failed: %s", req.rid, fault.message)
