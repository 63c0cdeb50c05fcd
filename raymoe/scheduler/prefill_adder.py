"""PrefillAdder: admits waiting requests into one prefill (EXTEND) batch under every budget.

Ownership: created by the ``Scheduler`` for one admission round and dropped afterwards. It matches prefixes in the
radix cache, locks them, and allocates ReqToTokenPool rows and KV slots for what it admits, writing them into the
requests (``req_pool_idx``, ``kv_slots``, ``prefix_len``, ``last_node``). Whatever it does not admit it leaves
untouched.

Budgets, all in tokens:

* ``max_prefill_tokens``: tokens computed by the whole batch (a single prompt may exceed it when chunking is off);
* ``chunked_prefill_size``: tokens per step; a longer prompt is cut into chunks over several steps, and the
  request being chunked keeps its row and slots in between (only one chunked request at a time);
* KV: ``free slots + evictable cached tokens - reserved``, where ``reserved`` covers the decode tokens running
  requests may still need (scaled by ``new_token_ratio``, the expected fraction of ``max_tokens`` actually
  generated) plus the uncomputed rest of a chunked prompt. A new request must fit its whole remaining prompt
  plus its own scaled reservation. When nothing else holds KV, the first request is admitted whenever its first
  chunk fits, so a request that fits the pool always makes progress;
* rows: at most ``max_new_reqs`` newly admitted requests.

With a paged allocator (``raymoe.kvcache.paged_allocator``) the KV budgets stay in tokens and may be off by up to
a page per request (page tails, cached tokens that free a page only together with its neighbours); an allocation
that then fails leaves the request waiting (NO_TOKEN), and decode retracts as usual.
"""

from __future__ import annotations

import math
from enum import Enum

from raymoe.kvcache.allocator import ReqSlotAllocator, TokenSlotAllocator
from raymoe.kvcache.paged_allocator import PagedTokenSlotAllocator
from raymoe.kvcache.radix_cache import RadixCache
from raymoe.scheduler.req import Req

MAX_PROMPT_SCORE_TOKENS = 1024
"""With chunked prefill on, the most tokens a request that still scores its prompt (``prompt_logprobs``) computes
in one step: its step's logits are that many float32 rows of the vocabulary (1024 x 152k entries: 0.6 GiB)."""


class AddResult(Enum):
    """Outcome of offering one request: keep offering (CONTINUE) or stop the round."""

    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # KV budget exhausted
    BATCH_FULL = "batch_full"  # token budget, row budget or chunk taken


def max_kv_len(req: Req, max_context_len: int) -> int:
    """Most KV tokens ``req`` can ever hold: its longest possible sequence minus the never-fed last token."""
    longest = min(len(req.origin_input_ids) + req.sampling_params.max_tokens, max_context_len)
    return max(longest - 1, req.seq_len)


def decode_reservation(req: Req, kv_len: int, new_token_ratio: float, max_context_len: int) -> int:
    """KV slots to hold back for the decode steps of ``req`` once its KV covers ``kv_len`` tokens."""
    return math.ceil(max(0, max_kv_len(req, max_context_len) - kv_len) * new_token_ratio)


class PrefillAdder:
    """Builds the request list and extend lengths of one prefill batch.

    Args:
        tree: the group's radix cache (prefix matches, locks, eviction).
        token_allocator: KV slots.
        req_allocator: ReqToTokenPool rows.
        max_prefill_tokens: token budget of the batch.
        chunked_prefill_size: most tokens per step, or ``None`` (no chunking).
        max_new_reqs: most requests this round may newly admit (rows and ``max_running_requests``).
        reserved_tokens: KV slots already promised to running requests and a chunked request.
        new_token_ratio: fraction of each new request's remaining ``max_tokens`` to reserve, in [0, 1].
        max_context_len: longest sequence in tokens.
        pool_idle: no other request holds KV (guarantees progress for the first request).
        hit_cut: tokens taken off the end of each radix-cache hit (recomputed by the request; 1 for ``nextn``).

    Attributes:
        reqs: admitted requests (a continued chunked request first), in batch order.
        extend_lens: tokens each computes this step.
        new_chunked_req: the request whose prompt is still unfinished after this step, or ``None``.
    """

    def __init__(self, *, tree: RadixCache, token_allocator: TokenSlotAllocator | PagedTokenSlotAllocator,
                 req_allocator: ReqSlotAllocator,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, max_new_reqs: int, reserved_tokens: int,
                 new_token_ratio: float, max_context_len: int, pool_idle: bool, hit_cut: int = 0):
        self.tree = tree
        self.hit_cut = hit_cut
        self.token_allocator = token_allocator
        self.req_allocator = req_allocator
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.max_new_reqs = max_new_reqs
        self.reserved = reserved_tokens
        self.new_token_ratio = new_token_ratio
        self.max_context_len = max_context_len
        self.pool_idle = pool_idle
        self.reqs: list[Req] = []
        self.extend_lens: list[int] = []
        self.new_chunked_req: Req | None = None
        self._num_new = 0

    # ------------------------------------------------------------------------------------------ budgets
    def _step_limit(self) -> int:
        """Tokens the next request may compute this step."""
        if self.rem_chunk_tokens is None:
            return self.rem_input_tokens
        return min(self.rem_input_tokens, self.rem_chunk_tokens)

    def _limit_for(self, req: Req) -> int:
        """Tokens ``req`` may compute this step: :meth:`_step_limit`, and with chunked prefill on at most
        :data:`MAX_PROMPT_SCORE_TOKENS` while it still scores its prompt (its step's logits are that many rows of
        the vocabulary)."""
        limit = self._step_limit()
        if self.rem_chunk_tokens is not None and req.prompt_scored_to is not None:
            limit = min(limit, MAX_PROMPT_SCORE_TOKENS)
        return limit

    def _free_kv(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.token_allocator.available_size() + self.tree.evictable_size()

    def _alloc_slots(self, n: int, after: int | None = None) -> list[int] | None:
        """``n`` slots continuing after slot ``after``, evicting cached prefixes while short
        (``RadixCache.alloc_evicting``)."""
        return self.tree.alloc_evicting(n, after)

    def _record(self, req: Req, extend: int, remaining: int) -> AddResult:
        """Book ``extend`` of the ``remaining`` prompt tokens of an admitted request."""
        self.reqs.append(req)
        self.extend_lens.append(extend)
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend
        self.reserved += (remaining - extend) + decode_reservation(
            req, req.seq_len, self.new_token_ratio, self.max_context_len)
        if extend < remaining:
            self.new_chunked_req = req
            return AddResult.BATCH_FULL
        return AddResult.CONTINUE if self._step_limit() > 0 else AddResult.BATCH_FULL

    # ---------------------------------------------------------------------------------------- admission
    def add_chunked_req(self, req: Req) -> AddResult:
        """Continue the chunked request with its next chunk (as large as the budgets and free KV allow).

        Its prompt was budgeted when it was first admitted, so only free plus evictable KV (plus the rest of its
        last page, with a paged allocator) limits the chunk.
        Returns NO_TOKEN (and leaves it chunked, computing nothing) when not a single slot is obtainable.
        """
        self.new_chunked_req = req
        remaining = req.seq_len - req.kv_len
        last = req.kv_slots[-1]
        extend = min(remaining, self._limit_for(req), self._free_kv() + self.token_allocator.room_after(last))
        if extend <= 0:
            return AddResult.NO_TOKEN
        slots = self._alloc_slots(extend, after=last)
        if slots is None:  # token slots: cannot happen (_free_kv counted only obtainable slots); pages: can
            return AddResult.NO_TOKEN
        req.kv_slots += slots
        self.new_chunked_req = None
        return self._record(req, extend, remaining)

    def add_one_req(self, req: Req) -> AddResult:
        """Try to admit a waiting request (match its prefix, lock it, take a row and slots).

        The match is capped at ``seq_len - 1`` tokens so at least the last token is computed (its logits give
        the next token), and before the prompt positions whose log-probs the request still needs
        (``Req.prompt_scored_to``); with a paged allocator it is also cut to whole pages, so the request's own
        slots start on a fresh page. On refusal the request keeps no row, slot or lock (the lookup itself still
        counts in the cache's hit statistics and LRU clock).
        """
        if self._num_new >= self.max_new_reqs:
            return AddResult.BATCH_FULL
        if self._step_limit() <= 0:
            return AddResult.BATCH_FULL
        limit = self._limit_for(req)
        ids = req.fill_ids
        page = self.token_allocator.page_size
        reuse = len(ids) - 1
        if (scored_to := req.prompt_scored_to) is not None:  # prompt log-probs: those positions must be computed
            reuse = min(reuse, scored_to)
        match = self.tree.match_prefix(ids[: reuse // page * page])
        # With pages, only whole pages laid out in position order can be shared (raymoe.kvcache.paged_allocator):
        # a cached path may mix two requests' slots inside a page. Lock exactly the part the request uses.
        # ``hit_cut``: positions at the end of a hit recomputed anyway (nextn: the MTP layer's KV entry of a cached
        # position also depends on the token after it, which the cache key does not hold)
        prefix = self.token_allocator.aligned_prefix_len(match.slots[:max(len(match.slots) - self.hit_cut, 0)])
        if prefix < len(match.slots):
            match = self.tree.cut_match(match, prefix)
        self.tree.inc_lock_ref(match.last_node)  # from here the prefix is protected (no longer evictable)
        remaining = len(ids) - prefix
        if remaining <= limit:
            extend = remaining
        elif self.rem_chunk_tokens is not None:
            extend = limit
        elif not self.reqs:
            extend = remaining  # one prompt may exceed max_prefill_tokens when chunking is off
        else:
            self.tree.dec_lock_ref(match.last_node)
            return AddResult.BATCH_FULL
        if self.pool_idle and not self.reqs:
            fits = extend <= self._free_kv()
        else:
            future = decode_reservation(req, len(ids), self.new_token_ratio, self.max_context_len)
            fits = remaining + future <= self._free_kv() - self.reserved
        if not fits:
            self.tree.dec_lock_ref(match.last_node)
            return AddResult.NO_TOKEN
        row = self.req_allocator.alloc()
        if row is None:
            self.tree.dec_lock_ref(match.last_node)
            return AddResult.BATCH_FULL
        slots = self._alloc_slots(extend)
        if slots is None:  # token slots: cannot happen (the fit check counted only obtainable slots); pages: can
            self.req_allocator.free(row)
            self.tree.dec_lock_ref(match.last_node)
            return AddResult.NO_TOKEN
        req.req_pool_idx = row
        req.kv_slots = match.slots + slots
        req.prefix_len = prefix
        req.last_node = match.last_node
        req.cached_tokens += prefix
        self._num_new += 1
        return self._record(req, extend, remaining)
