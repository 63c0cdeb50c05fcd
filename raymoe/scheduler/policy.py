"""Order of the waiting queue before each prefill admission round.

``fcfs``: first come, first served by arrival order. A retracted request keeps its original arrival, so it goes
back ahead of requests that came after it.

``lpm`` (longest prefix match first): requests whose prompt shares the longest prefix with the radix cache go
first (ties by arrival), which raises the cache hit rate when many prompts share a system prompt. The lookup
here is read-only (no node splits, no LRU refresh, no hit counters) so ordering does not disturb the cache or its
metrics. Long queues fall back to FCFS to bound the per-step cost, like SGLang does.
"""

from __future__ import annotations

from collections.abc import Sequence

from raymoe.kvcache.radix_cache import RadixCache
from raymoe.scheduler.req import Req

# Above this many waiting requests LPM degrades to FCFS (matching every prompt each step costs O(total tokens)).
LPM_MAX_QUEUE = 128

POLICIES = ("fcfs", "lpm")


def order_waiting(waiting: Sequence[Req], policy: str, tree: RadixCache) -> list[Req]:
    """Return the waiting requests in the order the ``PrefillAdder`` should try them.

    Args:
        waiting: requests waiting for (re-)prefill.
        policy: ``"fcfs"`` or ``"lpm"``.
        tree: the group's radix cache (read only; used by ``lpm``).

    Raises:
        ValueError: unknown ``policy``.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r}; expected one of {POLICIES}")
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE or tree.disable:
        return sorted(waiting, key=lambda r: r.arrival)
    # Cap at len - 1 like admission does: the last token is always computed.
    keyed = [(-tree.peek_prefix_len(r.fill_ids[: r.seq_len - 1]), r.arrival, r) for r in waiting]
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [t[2] for t in keyed]
