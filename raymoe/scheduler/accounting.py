"""KV accounting of one DP group: the usage gauge, the idle invariant and the full slot/row audit.

Ownership: read-only views of a :class:`~raymoe.scheduler.group_state.GroupState` (its allocators, radix cache and
requests); the group's ``Scheduler`` calls these for ``kv_usage`` / ``idle_report`` / ``check_memory_invariants``.
The driver sums the idle reports of its groups for metrics and for the stress benchmark; tests run the audit after
every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.scheduler.group_state import GroupState


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


def kv_usage(state: GroupState) -> float:
    """Fraction of KV slots holding tokens of requests or locked prefixes, in [0, 1] (evictable cached tokens count
    as free, and so do a paged allocator's stranded slots, which hold no token). O(1)."""
    alloc = state.token_allocator
    used = alloc.size - alloc.available_size() - alloc.stranded_size() - state.tree_cache.evictable_size()
    return used / alloc.size


def idle_report(state: GroupState) -> IdleReport | None:
    """The idle invariant's counts of ``state`` when it holds no unfinished request and no batch is in flight
    (``None`` otherwise). O(1)."""
    if state.unfinished or state.inflight:
        return None
    if state.kv_reservations or state.kv_exports:  # PD: KV held for the other engine is in use, not leaked
        return None
    alloc = state.token_allocator
    # A paged allocator's stranded slots (the rest of a page whose handed-out slots are cached) hold no token.
    return IdleReport(
        leaked_kv_slots=alloc.size - alloc.available_size() - alloc.stranded_size() - state.tree_cache.evictable_size(),
        leaked_req_rows=state.req_allocator.size - state.req_allocator.available_size(),
        locked_cache_tokens=state.tree_cache.protected_size())


def check_memory_invariants(state: GroupState) -> None:
    """Assert that every KV slot and row is accounted for exactly once (tests and debugging).

    Checks: free + radix-cache + owned by live requests + stranded (paged allocator) slots == pool size; owned
    slots are distinct and never the dummy slot 0; rows in use == live requests; waiting requests hold nothing; with
    no live request no radix lock is held. Raises ``AssertionError`` with details otherwise.
    """
    live = list(state.running) + ([state.chunked_req] if state.chunked_req is not None else [])
    owned: list[int] = []
    for r in live:
        assert r.req_pool_idx is not None, f"live request {r.rid!r} has no row"
        assert r.prefix_len <= r.kv_len, f"request {r.rid!r}: prefix_len {r.prefix_len} > kv_len {r.kv_len}"
        owned += r.kv_slots[r.prefix_len :]
    for r in state.waiting:
        assert r.req_pool_idx is None and not r.kv_slots and r.last_node is None, f"waiting {r.rid!r} holds KV"
    assert 0 not in owned, "dummy slot 0 is owned by a request"
    assert len(set(owned)) == len(owned), "a KV slot is owned by two requests (or twice by one)"
    reserved = [s for slots in state.kv_reservations.values() for s in slots]
    reserved += [s for export in state.kv_exports.values() for s in export.held]  # outside the tree, held for PD
    assert not set(reserved) & set(owned), "a KV slot is both reserved for a transfer and owned by a request"
    owned += reserved
    free, tree = state.token_allocator.available_size(), state.tree_cache.total_size()
    size, stranded = state.token_allocator.size, state.token_allocator.stranded_size()
    assert free + tree + len(owned) + stranded == size, (
        f"KV slots leak or double count: free {free} + tree {tree} + owned {len(owned)} (reserved "
        f"{len(reserved)}) + stranded {stranded} != size {size}")
    rows = state.req_allocator.size - state.req_allocator.available_size()
    assert rows == len(live), f"{rows} rows in use for {len(live)} live requests"
    if not live and not state.kv_exports:
        assert state.tree_cache.protected_size() == 0, "radix locks held with no live request"
