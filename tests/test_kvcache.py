"""Driver-side KV bookkeeping: slot/row allocators and the radix prefix cache (unit + hypothesis property tests)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from raymoe.kvcache.allocator import ReqSlotAllocator, TokenSlotAllocator
from raymoe.kvcache.radix_cache import RadixCache
from raymoe.kvcache.radix_node import TreeNode

# ------------------------------------------------------------------------------------------------ allocators


def test_token_allocator_basics():
    a = TokenSlotAllocator(4)
    assert a.size == 4 and a.available_size() == 4
    assert a.alloc(0) == []
    got = a.alloc(3)
    assert got == [1, 2, 3]  # a fresh pool counts upwards from 1, never 0
    assert a.alloc(2) is None and a.available_size() == 1  # no partial allocation
    a.free(got[1:])
    assert a.available_size() == 3
    with pytest.raises(ValueError, match="double free"):
        a.free([2])
    with pytest.raises(ValueError, match="dummy"):
        a.free([0])
    with pytest.raises(ValueError, match="outside"):
        a.free([5])
    with pytest.raises(ValueError):
        a.free([1, 1])  # repeated within one call
    with pytest.raises(ValueError):
        a.free([1, 2])  # 1 is allocated, 2 is not: nothing may be freed
    assert a.available_size() == 3
    a.free(iter([1]))  # any iterable
    assert a.available_size() == 4
    with pytest.raises(ValueError):
        a.alloc(-1)
    a.alloc(2)
    a.reset()
    assert a.available_size() == 4 and a.alloc(4) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        TokenSlotAllocator(0)


def test_req_allocator_basics():
    r = ReqSlotAllocator(3)
    rows = [r.alloc() for _ in range(3)]
    assert rows == [0, 1, 2] and r.alloc() is None and r.available_size() == 0
    r.free(1)
    with pytest.raises(ValueError, match="double free"):
        r.free(1)
    with pytest.raises(ValueError, match="outside"):
        r.free(3)
    assert r.alloc() == 1
    r.reset()
    assert r.available_size() == 3
    with pytest.raises(ValueError):
        ReqSlotAllocator(0)


def test_allocation_order_is_deterministic():
    def run() -> list[list[int] | None]:
        a, out = TokenSlotAllocator(16), []
        for n in (3, 5, 2):
            out.append(a.alloc(n))
        a.free(out[1])
        out.append(a.alloc(4))
        return out

    assert run() == run()


class TokenAllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences against a model set of handed-out slots."""

    def __init__(self):
        super().__init__()
        self.size = 12
        self.alloc = TokenSlotAllocator(self.size)
        self.held: list[list[int]] = []
        self.used: set[int] = set()

    @rule(n=st.integers(0, 14))
    def do_alloc(self, n):
        before = self.alloc.available_size()
        got = self.alloc.alloc(n)
        if n > self.size - len(self.used):
            assert got is None and self.alloc.available_size() == before
            return
        assert got is not None and len(got) == n == len(set(got))
        assert 0 not in got and all(1 <= s <= self.size for s in got)
        assert not self.used.intersection(got)
        self.used.update(got)
        self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def do_free(self, data):
        chunk = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.alloc.free(chunk)
        self.used.difference_update(chunk)

    @rule(slot=st.integers(-1, 13))
    def bad_free(self, slot):
        if slot in self.used:
            return
        before = self.alloc.available_size()
        with pytest.raises(ValueError):
            self.alloc.free([slot])
        assert self.alloc.available_size() == before

    @invariant()
    def accounting(self):
        assert self.alloc.available_size() == self.size - len(self.used)


TestTokenAllocatorMachine = TokenAllocatorMachine.TestCase
TestTokenAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------------------------- radix cache


def tree_map(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix (as a tuple of token ids) -> KV slot of its last token, read off the tree."""
    out: dict[tuple[int, ...], int] = {}
    stack = [((), cache.root_node)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok, slot in zip(child.key, child.value, strict=True):
                p = p + (tok,)
                out[p] = slot
            stack.append((p, child))
    return out


def make(size: int = 64, disable: bool = False) -> tuple[TokenSlotAllocator, RadixCache]:
    a = TokenSlotAllocator(size)
    return a, RadixCache(a, disable=disable)


def test_split_on_match():
    a, c = make()
    s = a.alloc(4)
    assert c.insert([1, 2, 3, 4], s) == 0
    m = c.match_prefix([1, 2, 9])
    assert m.slots == s[:2] and m.last_node.key == [1, 2] and m.last_node.value == s[:2]
    (lower,) = m.last_node.children.values()
    assert lower.key == [3, 4] and lower.value == s[2:] and lower.parent is m.last_node
    assert c.hit_tokens == 2 and c.queried_tokens == 3
    full = c.match_prefix([1, 2, 3, 4, 5])
    assert full.slots == s and full.last_node is lower  # ends at a node boundary: no further split
    empty = c.match_prefix([7])
    assert empty.slots == [] and empty.last_node is c.root_node
    assert c.match_prefix([]).last_node is c.root_node
    assert c.total_size() == 4 and c.evictable_size() == 4 and c.protected_size() == 0
    c._check_invariants()


def test_insert_splits_and_reports_cached_prefix():
    a, c = make()
    s1 = a.alloc(4)
    c.insert([1, 2, 3, 4], s1)
    s2 = a.alloc(3)
    assert c.insert([1, 2, 5], s2) == 2  # [1, 2] was cached: s2[:2] are duplicates
    a.free(s2[:2])
    assert tree_map(c) == {(1,): s1[0], (1, 2): s1[1], (1, 2, 3): s1[2], (1, 2, 3, 4): s1[3], (1, 2, 5): s2[2]}
    assert sorted(c.root_node.children[1].children) == [3, 5]
    assert c.insert([1, 2, 3], s1[:3]) == 3  # the tree's own slots: fully cached, nothing to free or store
    with pytest.raises(ValueError, match="insert: 2 token ids but 1 slots"):
        c.insert([1, 2], [s1[0]])
    assert a.available_size() + c.total_size() == a.size
    c._check_invariants()


def test_lru_evicts_least_recently_matched_leaf_first():
    a, c = make()
    seqs = {name: ([tok, tok], a.alloc(2)) for name, tok in (("A", 1), ("B", 2), ("C", 3))}
    for ids, slots in seqs.values():
        c.insert(ids, slots)
    c.match_prefix([1, 1])  # A is now the most recent; B the least
    assert c.evict(1) == 2  # whole nodes go
    assert set(tree_map(c)) == {(1,), (1, 1), (3,), (3, 3)}
    assert c.evict(2) == 2 and set(tree_map(c)) == {(1,), (1, 1)}
    assert c.evict(0) == 0
    assert c.evict(10) == 2 and c.total_size() == 0 and a.available_size() == a.size
    c._check_invariants()


def test_parent_becomes_evictable_after_its_children():
    a, c = make()
    s = a.alloc(3)
    c.insert([1, 2, 3], s)
    assert c.insert([1, 2, 4], s[:2] + a.alloc(1)) == 2
    assert c.evict(3) == 4  # leaves [3] and [4] (1 token each), then their parent [1, 2] (whole node: 2)
    assert c.total_size() == 0
    c._check_invariants()


def test_locked_prefix_survives_eviction():
    a, c = make()
    s = a.alloc(4)
    c.insert([1, 2, 3, 4], s)
    c.insert([5, 6], a.alloc(2))
    m = c.match_prefix([1, 2, 7])  # splits [1, 2] | [3, 4]
    c.inc_lock_ref(m.last_node)
    assert c.protected_size() == 2 and c.evictable_size() == 4
    assert c.evict(100) == 4
    assert tree_map(c) == {(1,): s[0], (1, 2): s[1]}
    c.inc_lock_ref(m.last_node)  # two requests on the same prefix
    c.dec_lock_ref(m.last_node)
    assert c.evict(100) == 0
    c.dec_lock_ref(m.last_node)
    with pytest.raises(ValueError, match="not locked"):
        c.dec_lock_ref(m.last_node)
    assert c.protected_size() == 0 and c.evictable_size() == 2
    assert c.evict(1) == 2
    with pytest.raises(ValueError, match="no longer in the tree"):
        c.inc_lock_ref(m.last_node)  # stale match result
    c.inc_lock_ref(c.root_node)  # root: no-op
    c.dec_lock_ref(c.root_node)
    assert a.available_size() == a.size
    c._check_invariants()


def test_disabled_cache_takes_ownership_and_stores_nothing():
    a, c = make(8, disable=True)
    m = c.match_prefix([1, 2, 3])
    assert m.slots == [] and m.last_node is c.root_node
    c.inc_lock_ref(m.last_node)
    slots = a.alloc(3)
    n = c.insert([1, 2, 3], slots)
    assert n == 0
    a.free(slots[len(m.slots) : n])  # the scheduler protocol, unchanged
    c.dec_lock_ref(m.last_node)
    assert a.available_size() == 8  # insert freed the slots: no leak
    assert c.total_size() == 0 and c.match_prefix([1, 2, 3]).slots == [] and c.evict(5) == 0
    assert c.hit_tokens == 0 and c.queried_tokens == 6
    c._check_invariants()


def test_scheduler_protocol_two_requests_sharing_a_prefix():
    a, c = make(32)
    system = [9, 8, 7]
    sys_slots = a.alloc(3)
    c.insert(system, sys_slots)

    def admit(ids):
        m = c.match_prefix(ids)
        c.inc_lock_ref(m.last_node)
        return m, m.slots + a.alloc(len(ids) - len(m.slots))

    def finish(ids, m, slots):
        n = c.insert(ids, slots)
        a.free(slots[len(m.slots) : n])
        c.dec_lock_ref(m.last_node)
        return n

    r1, r2 = system + [1, 2], system + [1, 3]
    m1, s1 = admit(r1)
    m2, s2 = admit(r2)
    assert m1.slots == m2.slots == sys_slots and c.protected_size() == 3
    assert finish(r1, m1, s1) == 3
    assert finish(r2, m2, s2) == 4  # r1 cached token 1 in between: r2's copy is a duplicate and freed
    assert tree_map(c)[tuple(system + [1])] == s1[3]
    assert c.match_prefix(r2).slots == s1[:4] + s2[4:]
    assert c.protected_size() == 0 and a.available_size() + c.total_size() == a.size == 32
    c._check_invariants()

    # Same new prompt admitted twice before either finishes: the second insert finds everything cached.
    p = [4, 4, 4, 4]
    m3, s3 = admit(p)
    m4, s4 = admit(p)
    assert m3.slots == m4.slots == []
    assert finish(p, m3, s3) == 0 and finish(p, m4, s4) == 4
    assert c.match_prefix(p).slots == s3
    assert a.available_size() + c.total_size() == a.size
    c._check_invariants()


def test_reset_frees_everything():
    a, c = make(16)
    s = a.alloc(3)
    c.insert([1, 2, 3], s)
    c.insert([1, 5], s[:1] + a.alloc(1))
    m = c.match_prefix([1, 2])
    c.inc_lock_ref(m.last_node)
    with pytest.raises(ValueError, match="locked"):
        c.reset()
    c.dec_lock_ref(m.last_node)
    c.reset()
    assert c.total_size() == 0 and not c.root_node.children
    assert a.available_size() == a.size
    assert c.hit_tokens == 2  # cumulative counters survive
    with pytest.raises(ValueError):
        c.inc_lock_ref(m.last_node)
    c._check_invariants()


def test_heap_stays_bounded_and_pretty_prints():
    a, c = make(16)
    s = a.alloc(3)
    c.insert([1, 2, 3], s)
    c.insert([1, 2, 4], s[:2] + a.alloc(1))
    for _ in range(1000):  # every match pushes a fresh entry for the touched leaf; stale ones pile up
        c.match_prefix([1, 2, 3])
        assert len(c._lru.heap) <= 2 * c._lru.num_nodes + 64
    text = c.pretty()
    assert "[1 2] tokens=2" in text and "[3] tokens=1" in text
    c._check_invariants()


token_seqs = st.lists(st.integers(0, 2), max_size=8)  # tiny alphabet: shared prefixes and splits everywhere


class RadixCacheMachine(RuleBasedStateMachine):
    """Requests following the scheduler protocol, bare matches/locks and evictions, checked against a model.

    The model maps every cached prefix (tuple of token ids) to the slot of its last token; a radix tree is exactly
    a prefix-closed set of such entries. Running requests own the slots after their matched prefix.
    """

    SIZE = 40

    def __init__(self):
        super().__init__()
        self.alloc = TokenSlotAllocator(self.SIZE)
        self.cache = RadixCache(self.alloc)
        self.model: dict[tuple[int, ...], int] = {}
        self.reqs: list[tuple[list[int], list[int], object]] = []  # (ids, slots, match) of running requests
        self.locks: list = []  # bare locked match results
        self.hits = self.queries = 0

    # --------------------------------------------------------------------------------------------- helpers
    def expected(self, ids) -> list[int]:
        out: list[int] = []
        while len(out) < len(ids) and tuple(ids[: len(out) + 1]) in self.model:
            out.append(self.model[tuple(ids[: len(out) + 1])])
        return out

    def match(self, ids):
        m = self.cache.match_prefix(ids)
        assert m.slots == self.expected(ids)
        self.hits += len(m.slots)
        self.queries += len(ids)
        return m

    def locked_slots(self, extra=None) -> set[int]:
        matches = [m for _, _, m in self.reqs] + self.locks + ([extra] if extra else [])
        return {s for m in matches for s in m.slots}

    def evict(self, n: int, extra=None) -> None:
        locked, before, avail = self.locked_slots(extra), tree_map(self.cache), self.alloc.available_size()
        freed = self.cache.evict(n)
        after = tree_map(self.cache)
        assert after.items() <= before.items()  # survivors keep their slots
        removed = {k: v for k, v in before.items() if k not in after}
        assert freed == len(removed) and self.alloc.available_size() == avail + freed
        assert not locked.intersection(removed.values()), "evicted a locked slot"
        assert freed >= n or self.cache.evictable_size() == 0
        for k in removed:
            del self.model[k]

    def alloc_slots(self, n: int, extra=None) -> list[int] | None:
        if self.alloc.available_size() < n:
            self.evict(n - self.alloc.available_size(), extra)
        return self.alloc.alloc(n)

    def insert(self, ids, slots) -> int:
        n = self.cache.insert(ids, slots)
        assert n == len(self.expected(ids))
        for i in range(n, len(ids)):
            self.model[tuple(ids[: i + 1])] = slots[i]
        return n

    # ----------------------------------------------------------------------------------------------- rules
    @rule(ids=token_seqs)
    def admit(self, ids):
        m = self.match(ids)
        self.cache.inc_lock_ref(m.last_node)
        own = self.alloc_slots(len(ids) - len(m.slots), extra=m)
        if own is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        self.reqs.append((ids, m.slots + own, m))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        ids, slots, m = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        assert self.expected(ids)[: len(m.slots)] == m.slots  # the locked prefix is intact
        kv_len = data.draw(st.integers(len(m.slots), len(ids)))
        n = self.insert(ids[:kv_len], slots[:kv_len])
        assert n >= len(m.slots)
        self.alloc.free(slots[len(m.slots) : n])
        self.alloc.free(slots[kv_len:])  # KV never cached (e.g. aborted mid-way)
        self.cache.dec_lock_ref(m.last_node)

    @rule(ids=token_seqs)
    def insert_fresh(self, ids):
        slots = self.alloc_slots(len(ids))
        if slots is None:
            return
        had = self.expected(ids)
        n = self.insert(ids, slots)
        self.alloc.free(slots[:n])  # none of them came from the tree
        m = self.match(ids)
        assert m.slots == had + slots[n:]
        if not had:
            assert m.slots == slots

    @rule(ids=token_seqs)
    def bare_match(self, ids):
        self.match(ids)

    @rule(ids=token_seqs)
    def lock(self, ids):
        m = self.match(ids)
        self.cache.inc_lock_ref(m.last_node)
        self.locks.append(m)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        m = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(m.last_node)

    @rule(ids=token_seqs)
    def peek(self, ids):
        c = self.cache
        before = (c.hit_tokens, c.queried_tokens, c._clock, c._lru.num_nodes)  # no counters, LRU refresh, split
        assert c.peek_prefix_len(ids) == len(self.expected(ids))
        assert (c.hit_tokens, c.queried_tokens, c._clock, c._lru.num_nodes) == before

    @rule(ids=token_seqs, data=st.data())
    def cut_and_lock(self, ids, data):
        """Lock only the first ``n`` tokens of a match (paged KV uses whole pages of it)."""
        m = self.match(ids)
        n = data.draw(st.integers(0, len(m.slots)))
        cut = self.cache.cut_match(m, n)
        assert cut.slots == m.slots[:n]
        depth, node = 0, cut.last_node
        while node is not self.cache.root_node:  # the cut's node ends exactly after its n tokens
            depth += len(node.key)
            node = node.parent
        assert depth == n
        self.cache.inc_lock_ref(cut.last_node)
        self.locks.append(cut)

    @rule(n=st.integers(0, 16))
    def evict_rule(self, n):
        self.evict(n)

    @precondition(lambda self: not self.reqs and not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()
        self.model.clear()
        assert self.alloc.available_size() == self.SIZE

    # ------------------------------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        c = self.cache
        c._check_invariants()
        tree = tree_map(c)
        assert tree == self.model
        assert c.evictable_size() + c.protected_size() == c.total_size() == len(tree)
        assert c.protected_size() == len(self.locked_slots())  # protected = exactly the locked paths
        own = [s for _, slots, m in self.reqs for s in slots[len(m.slots) :]]
        owned = list(tree.values()) + own
        assert len(set(owned)) == len(owned), "a slot has two owners"
        assert 0 not in owned
        assert self.alloc.available_size() + len(owned) == self.SIZE, "leaked or double-owned slots"
        assert (c.hit_tokens, c.queried_tokens) == (self.hits, self.queries)

    def teardown(self):
        for m in self.locks:
            self.cache.dec_lock_ref(m.last_node)
        for ids, slots, m in self.reqs:
            n = self.cache.insert(ids, slots)
            self.alloc.free(slots[len(m.slots) : n])
            self.cache.dec_lock_ref(m.last_node)
        assert self.cache.protected_size() == 0
        self.cache.evict(self.SIZE)
        assert self.cache.total_size() == 0 and self.alloc.available_size() == self.SIZE


TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)


def test_peek_follows_several_nodes_without_touching_the_tree():
    a, c = make()
    c.insert([1, 2, 3, 4], a.alloc(4))
    c.insert([1, 2, 5, 6], c.match_prefix([1, 2]).slots + a.alloc(2))  # [1 2] | [3 4], [5 6]
    before = c.pretty()
    assert c.peek_prefix_len([1, 2, 5, 6]) == 4  # two whole nodes: ends exactly at a leaf
    assert c.peek_prefix_len([1, 2, 5, 6, 7]) == 4
    assert c.peek_prefix_len([1, 2, 5, 9]) == 3  # ends inside a node
    assert c.peek_prefix_len([1, 9]) == 1 and c.peek_prefix_len([9]) == 0 and c.peek_prefix_len([]) == 0
    assert c.pretty() == before


def test_cut_match_inside_a_deeper_node_and_the_clock_of_its_parts():
    a, c = make()
    s = a.alloc(10)
    c.insert(list(range(1, 5)), s[:4])
    c.insert(list(range(1, 11)), s)  # [1..4] | [5..10]
    m = c.match_prefix(list(range(1, 11)))
    cut = c.cut_match(m, 7)  # inside the second node, which starts 4 tokens deep
    assert cut.slots == s[:7] and cut.last_node.key == [5, 6, 7] and cut.last_node.parent.key == [1, 2, 3, 4]
    assert cut.last_node.last_access == m.last_node.last_access  # the split keeps the node's LRU stamp
    c.inc_lock_ref(cut.last_node)
    assert c.protected_size() == 7 and c.evict(100) == 3  # only the uncut tail [8 9 10] could go
    c.dec_lock_ref(cut.last_node)
    c._check_invariants()


def test_pretty_prints_every_node_indented_by_depth():
    a, c = make()
    c.insert(list(range(1, 12)), a.alloc(11))  # [1 .. 11]
    c.insert([1, 2, 40, 41, 42, 43, 44, 45, 46, 47], c.match_prefix([1, 2]).slots + a.alloc(8))
    assert c.pretty() == "\n".join([
        "root evictable=19 protected=0",
        "  [1 2] tokens=2 lock=0 t=3",
        "    [3 4 5 6 7 8 9 10 ...] tokens=9 lock=0 t=1",  # 9 tokens: the first 8, then "..."
        "    [40 41 42 43 44 45 46 47] tokens=8 lock=0 t=3",  # exactly 8: all of them
    ])


def _two_level_tree() -> RadixCache:
    """root -> [1 2] -> {[3], [4 5]}, nothing locked."""
    a, c = make()
    s = a.alloc(3)
    c.insert([1, 2, 3], s)
    c.insert([1, 2, 4, 5], s[:2] + a.alloc(2))
    c._check_invariants()
    return c


def _corrupt(case: str, c: RadixCache) -> None:
    upper = c.root_node.children[1]
    leaf, deep = upper.children[3], upper.children[4]
    if case == "root_locks":
        c.root_node.lock_ref = 2
    elif case == "root_value":
        c.root_node.value = [7]
    elif case == "root_parent":
        c.root_node.parent = TreeNode([], [], None, 0, 0)
    elif case == "child_parent":
        deep.parent = c.root_node
    elif case == "child_key":
        del upper.children[4]
        upper.children[9] = deep
    elif case == "child_locked_more_than_parent":
        leaf.lock_ref = 1  # counted as protected, the counters agree; only the lock order is broken
        c._lru.evictable -= 1
        c._lru.protected += 1
    elif case == "slot_zero":
        leaf.value = [0]


@pytest.mark.parametrize("case", ["root_locks", "root_value", "root_parent", "child_parent", "child_key",
                                  "child_locked_more_than_parent", "slot_zero"])
def test_invariant_check_catches_each_corruption(case):
    """The tests lean on ``_check_invariants``; each check in it must be able to fail on its own."""
    c = _two_level_tree()
    _corrupt(case, c)
    with pytest.raises(AssertionError):
        c._check_invariants()
