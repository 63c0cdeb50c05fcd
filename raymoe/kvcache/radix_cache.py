"""Radix tree from token-id prefixes to KV slots, with lock counts and LRU eviction of unlocked leaves.

Ownership: one ``RadixCache`` per DP-attention group lives on the driver, next to that group's
``TokenSlotAllocator``; ranks never see it, only the slot numbers the scheduler ships. Plain Python throughout.

Algorithm: RadixAttention's prefix cache (SGLang; Zheng et al. 2023, "SGLang: Efficient Execution of Structured
Language Model Programs"). Each edge holds a run of token ids (``key``) and their KV slots (``value``); children are
keyed by their first token id. A running request locks the path of its matched prefix so eviction, which only
removes unlocked leaves in least-recently-used order, cannot take KV it is reading. The tree's records live in
``raymoe.kvcache.radix_node``, the lock counts and eviction order in ``raymoe.kvcache.radix_lru``.
"""

from __future__ import annotations

from collections.abc import Sequence

from raymoe.kvcache.allocator import TokenSlotAllocator
from raymoe.kvcache.prefix_events import PrefixEventLog
from raymoe.kvcache.radix_lru import LockedLRU
from raymoe.kvcache.radix_node import MatchResult, TreeNode, common_prefix_len, format_tree, iter_nodes

__all__ = ["MatchResult", "RadixCache", "TreeNode"]


class RadixCache:
    """Prefix cache of one DP group: token ids -> KV slots, shared by requests (SGLang RadixAttention).

    Sizes are in tokens (= slots). Every slot in the tree is owned by the tree: it came from ``allocator`` through
    the caller and goes back to ``allocator`` on eviction or reset.

    Scheduler protocol (leak-free, also with concurrent requests sharing a prefix)::

        m = cache.match_prefix(ids)              # on admission; m.slots are the tree's, read-only for the request
        cache.inc_lock_ref(m.last_node)          # keep them from being evicted
        own = allocator.alloc(len(ids) - len(m.slots))   # the request owns these; slots = m.slots + own (+ decode)
        ...
        n = cache.insert(ids[:kv_len], slots)    # on finish; len(slots) == kv_len
        allocator.free(slots[len(m.slots):n])    # our copies of tokens someone else cached meanwhile
        cache.dec_lock_ref(m.last_node)

    Why this is exact: while the lock is held the path of ``m`` cannot be evicted, so ``ids[:len(m.slots)]`` is
    still cached with exactly ``m.slots`` and ``n >= len(m.slots)``. Tokens ``[len(m.slots), n)`` were cached by
    another request after our match (e.g. two requests with the same new prompt); the tree keeps its own slots for
    them and ours are duplicates, which the caller frees. Tokens ``[n, kv_len)`` pass to the tree. So after the
    sequence each of the request's slots is either in the tree or free, never both, never neither.

    A chunked (unfinished) request that inserts what it has so far follows the same three lines, then re-matches
    (``m2 = match_prefix(ids)``, which returns the tree's slots for all of ``ids``), locks ``m2.last_node``,
    unlocks the old node, and replaces the first ``len(m2.slots)`` entries of its slot row by ``m2.slots`` (the
    re-match adds to the hit counters). With a disabled cache it skips all this: ``insert`` would free its slots.

    Disabled cache (``disable=True``): ``match_prefix`` returns an empty match at the root (locking the root is a
    no-op) and ``insert`` returns 0 and frees *all* the slots passed to it into the allocator, since by the contract
    above the tree takes ownership of ``slots[n:]``. The protocol above therefore needs no special case.

    Args:
        allocator: where evicted and reset slots are freed to.
        disable: turn prefix caching off (see above).

    Attributes:
        root_node: root of the tree (empty key, always locked, never evicted).
        hit_tokens: cumulative tokens matched over all ``match_prefix`` calls (the radix hit counter).
        queried_tokens: cumulative tokens asked about in ``match_prefix`` calls.
        events: the log of block hashes stored and evicted (``record_events``), or None.
    """

    def __init__(self, allocator: TokenSlotAllocator, disable: bool = False):
        self.allocator = allocator
        self.disable = disable
        self.hit_tokens = 0
        self.queried_tokens = 0
        self._clock = 0
        self._next_id = 0
        self.events: PrefixEventLog | None = None
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = TreeNode([], [], None, self._new_id(), 0)
        self.root_node.lock_ref = 1  # never evictable; inc/dec_lock_ref never touch the root
        self._lru = LockedLRU(self.root_node, on_evict=self._evicted)

    def record_events(self, log: PrefixEventLog) -> None:
        """Report every inserted path and every evicted leaf to ``log`` from now on (a router elsewhere keeps an
        index of what this tree holds: ``raymoe.kvcache.prefix_events``). What the tree holds already is reported
        as stored now."""
        self.events = log
        for node in iter_nodes(self.root_node):
            if node is not self.root_node and not node.children:
                path = _path_of(node)
                log.stored(path, 0)

    def _evicted(self, node: TreeNode) -> None:
        """``node`` (a leaf, still attached) is about to leave the tree."""
        if self.events is not None:
            path = _path_of(node)
            self.events.removed(path, len(path) - len(node.key))

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # ----------------------------------------------------------------------------------------------- lookups
    def peek_prefix_len(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids`` cached as a prefix, read-only: no node split, no LRU refresh, no hit counters
        (used to order the waiting queue). Returns 0 for a disabled or empty cache."""
        node = self.root_node
        i, n = 0, len(token_ids)
        while i < n:
            child = node.children.get(token_ids[i])
            if child is None:
                break
            k = common_prefix_len(child.key, token_ids, i)
            i += k
            if k < len(child.key):
                break
            node = child
        return i

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Find the longest cached prefix of ``token_ids``.

        Splits a node when the match ends inside it (so ``last_node`` covers exactly the matched tokens), refreshes
        the LRU clock of every node on the path, and adds to ``queried_tokens``/``hit_tokens``. A disabled cache
        returns an empty match at the root. Cost: O(len(token_ids)).
        """
        self.queried_tokens += len(token_ids)
        if self.disable or len(token_ids) == 0:
            return MatchResult([], self.root_node)
        slots: list[int] = []
        node, matched = self._walk(list(token_ids), slots)
        self.hit_tokens += matched
        self._lru.touched(node)  # its last_access changed
        return MatchResult(slots, node)

    def insert(self, token_ids: Sequence[int], slots: Sequence[int]) -> int:
        """Cache ``slots`` as the KV of ``token_ids`` and return how many leading tokens were already cached.

        With ``n`` the return value: the tree keeps its own slots for ``token_ids[:n]`` and takes ownership of
        ``slots[n:]``. The caller still owns ``slots[:n]``: of those, the ones it got from ``match_prefix`` are the
        tree's own (do not free them); the others are duplicates it must free (see the class docstring). A disabled
        cache returns 0 and frees all of ``slots`` into the allocator. Refreshes the LRU clock on the path.

        Raises:
            ValueError: ``len(token_ids) != len(slots)``.
        """
        if len(token_ids) != len(slots):
            raise ValueError(f"insert: {len(token_ids)} token ids but {len(slots)} slots")
        if self.disable:
            self.allocator.free(slots)
            return 0
        ids = list(token_ids)
        node, matched = self._walk(ids, None)
        if matched < len(ids):
            leaf = TreeNode(ids[matched:], list(slots[matched:]), node, self._new_id(), self._clock)
            node.children[ids[matched]] = leaf
            self._lru.added_leaf(leaf)
            node = leaf
            if self.events is not None:
                self.events.stored(ids, matched)
        self._lru.touched(node)
        return matched

    def _walk(self, ids: list[int], out_slots: list[int] | None) -> tuple[TreeNode, int]:
        """Follow ``ids`` from the root, splitting the last node if the match ends inside it; touch the path."""
        self._clock += 1
        now = self._clock
        node = self.root_node
        i, n = 0, len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            klen = len(child.key)
            if ids[i : i + klen] == child.key:
                k = klen
            else:
                k = common_prefix_len(child.key, ids, i)
                child = self._split(child, k)
            child.last_access = now
            if out_slots is not None:
                out_slots += child.value
            node = child
            i += k
            if k < klen:
                break
        return node, i

    def cut_match(self, match: MatchResult, n: int) -> MatchResult:
        """The first ``n`` tokens of ``match`` (``0 <= n <= len(match.slots)``, taken before any eviction) as a match
        of their own, whose ``last_node`` ends exactly after them (splitting a node if needed; counters and LRU
        clock untouched). For a caller that uses only part of a match (paged KV: whole pages) and should lock no
        more than it uses.
        """
        node, depth = match.last_node, len(match.slots)
        while depth > n:
            start = depth - len(node.key)
            if start >= n:
                node, depth = node.parent, start
            else:
                node, depth = self._split(node, n - start), n
        return MatchResult(match.slots[:n], node)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut ``node`` after its first ``k`` tokens (0 < k < len); return the new upper part."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.key)
        upper = TreeNode(node.key[:k], node.value[:k], parent, self._new_id(), node.last_access)
        upper.lock_ref = node.lock_ref  # every lock through node also runs through upper
        parent.children[node.key[0]] = upper
        node.key = node.key[k:]
        node.value = node.value[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        self._lru.added_split()
        return upper

    # ------------------------------------------------------------------------------------------------- locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors against eviction (one more lock each). The root is a no-op.

        Raises:
            ValueError: ``node`` is no longer in the tree (evicted or dropped by ``reset`` since it was matched).
        """
        if node.parent is None:
            if node is self.root_node:
                return
            raise ValueError(f"inc_lock_ref: {node!r} is no longer in the tree")
        self._lru.lock(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one lock taken by ``inc_lock_ref(node)`` on ``node`` and its ancestors. The root is a no-op.

        Raises:
            ValueError: the lock count of ``node`` would go negative (nothing is changed).
        """
        if node is self.root_node:
            return
        if node.lock_ref <= 0:  # ancestors hold at least as many locks as node, so checking node suffices
            raise ValueError(f"dec_lock_ref: {node!r} is not locked")
        self._lru.unlock(node)

    # ---------------------------------------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """Evict least-recently-used unlocked leaves until at least ``num_tokens`` slots were freed or nothing
        evictable remains; freed slots go back to the allocator. A parent whose last child goes becomes a leaf
        and a candidate itself. Whole nodes are evicted, so this may free more than asked.

        Returns:
            number of slots freed (tokens evicted).
        """
        freed = self._lru.evict(num_tokens)
        if freed:
            self.allocator.free(freed)
        return len(freed)

    def alloc_evicting(self, n: int, after: int | None = None) -> list[int] | None:
        """``n`` slots from the allocator (continuing after slot ``after``, which only the paged allocator reads),
        evicting least-recently-used unlocked prefixes while short; None when even eviction cannot free enough. With
        pages, evicted tokens free a page only once all of its tokens are gone, hence the loop."""
        alloc = self.allocator
        slots = alloc.alloc(n, after)
        while slots is None and self.evictable_size() > 0:
            self.evict(max(1, n - alloc.available_size()))
            slots = alloc.alloc(n, after)
        return slots

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (what ``evict`` could free)."""
        return self._lru.evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._lru.protected

    def total_size(self) -> int:
        """Tokens (= slots) held by the tree: ``evictable_size() + protected_size()``."""
        return self._lru.evictable + self._lru.protected

    def reset(self) -> None:
        """Drop every node and free all tree slots into the allocator (hit counters are kept: they are cumulative).

        Call it before resetting the allocator (or instead of that), never after, or the frees are double frees.
        Outstanding ``MatchResult`` nodes become stale (``inc_lock_ref`` on them raises).

        Raises:
            ValueError: a running request still holds a lock (``protected_size() > 0``); nothing is changed.
        """
        if self._lru.protected:
            raise ValueError(f"reset: {self._lru.protected} cached tokens are still locked by running requests")
        freed: list[int] = []
        for node in iter_nodes(self.root_node):
            freed += node.value
            node.parent = None
        if freed:
            self.allocator.free(freed)
        if self.events is not None:
            self.events.cleared()
        self._init_tree()

    # ------------------------------------------------------------------------------------------------ debug
    def pretty(self) -> str:
        """Indented dump of the tree: key (first tokens), slots count, lock count and last access per node."""
        return format_tree(self.root_node, f"root evictable={self._lru.evictable} protected={self._lru.protected}")

    def _check_invariants(self) -> None:
        """Walk the whole tree and assert its structure and counters (tests only; O(tree))."""
        root = self.root_node
        assert root.parent is None and root.key == [] and root.value == [] and root.lock_ref == 1
        evictable = protected = nodes = 0
        slots: set[int] = set()
        lru = self._lru
        live = {(e[0], e[1]) for e in lru.heap if lru.is_current(e[2], e[0])}
        for node in iter_nodes(root):
            nodes += 1
            for tok, child in node.children.items():
                assert child.parent is node and child.key and child.key[0] == tok
            if node is root:
                continue
            assert len(node.key) == len(node.value) > 0
            assert node.lock_ref >= 0 and (node.parent is root or node.lock_ref <= node.parent.lock_ref)
            assert node.last_access <= self._clock
            assert not slots.intersection(node.value) and 0 not in node.value
            slots.update(node.value)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    assert (node.last_access, node.node_id) in live, f"unlocked leaf {node!r} missing from heap"
        assert nodes == lru.num_nodes
        assert (evictable, protected) == (lru.evictable, lru.protected)
        assert len(slots) == evictable + protected


def _path_of(node: TreeNode) -> list[int]:
    """The token ids from the root to the end of ``node`` (O(depth))."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key]
