"""KV accounting checks of one DP group's scheduler: the idle invariant and the full slot/row audit.

Ownership: read-only views of a :class:`~raymoe.scheduler.scheduler.Scheduler`'s allocators, radix cache and
requests (the scheduler's ``idle_report`` / ``check_memory_invariants`` call these). The driver sums the idle
reports of its groups for metrics and for the stress benchmark; tests run the audit after every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raymoe.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class IdleReport:
    """KV accounting of one DP group while it holds no request (all counts in slots or rows).

    The idle invariant: with no request in flight every KV slot is free or held by an unlocked (evictable)
    radix-cache node, and every ReqToTokenPool row is free. Non-zero fields are leaks.

    Attributes:
        leaked_kv_slots: slots neither free nor held by the radix cache.
        leaked_req_rows: rows in use.
        locked_cache_tokens: radix-cache tokens still locked (protected) although no request holds them.
    """

    leaked_kv_slots: int
    leaked_req_rows: int
    locked_cache_tokens: int

    @property
    def clean(self) -> bool:
        """Whether the idle invariant holds."""
        return self.leaked_kv_slots == 0 and self.leaked_req_rows == 0 and self.locked_cache_tokens == 0


def idle_report(sched: Scheduler) -> IdleReport | None:
    """The idle invariant's counts of ``sched`` when it holds no unfinished request and no batch is in flight
    (``None`` otherwise). O(1)."""
    if sched._unfinished or sched._inflight:
        return None
    size = sched.token_allocator.size
    return IdleReport(
        leaked_kv_slots=size - sched.token_allocator.available_size() - sched.tree_cache.evictable_size(),
        leaked_req_rows=sched.req_allocator.size - sched.req_allocator.available_size(),
        locked_cache_tokens=sched.tree_cache.protected_size())


def check_memory_invariants(sched: Scheduler) -> None:
    """Assert that every KV slot and row is accounted for exactly once (tests and debugging).

    Checks: free + radix-cache + owned by live requests + stranded (paged allocator) slots == pool size; owned
    slots are distinct and never the dummy slot 0; rows in use == live requests; waiting requests hold nothing; with
    no live request no radix lock is held. Raises ``AssertionError`` with details otherwise.
    """
    live = list(sched.running) + ([sched.chunked_req] if sched.chunked_req is not None else [])
    owned: list[int] = []
    for r in live:
        assert r.req_pool_idx is not None, f"live request {r.rid!r} has no row"
        assert r.prefix_len <= r.kv_len, f"request {r.rid!r}: prefix_len {r.prefix_len} > kv_len {r.kv_len}"
        owned += r.kv_slots[r.prefix_len :]
    for r in sched.waiting:
        assert r.req_pool_idx is None and not r.kv_slots and r.last_node is None, f"waiting {r.rid!r} holds KV"
    assert 0 not in owned, "dummy slot 0 is owned by a request"
    assert len(set(owned)) == len(owned), "a KV slot is owned by two requests (or twice by one)"
    free, tree = sched.token_allocator.available_size(), sched.tree_cache.total_size()
    size, stranded = sched.token_allocator.size, sched.token_allocator.stranded_size()
    assert free + tree + len(owned) + stranded == size, (
        f"KV slots leak or double count: free {free} + tree {tree} + owned {len(owned)} + stranded {stranded} "
        f"!= size {size}")
    rows = sched.req_allocator.size - sched.req_allocator.available_size()
    assert rows == len(live), f"{rows} rows in use for {len(live)} live requests"
    if not live:
        assert sched.tree_cache.protected_size() == 0, "radix locks held with no live request"
