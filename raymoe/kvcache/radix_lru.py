"""Lock accounting and LRU eviction over the radix cache's tree.

Ownership: one :class:`LockedLRU` per tree, owned by ``raymoe.kvcache.radix_cache.RadixCache`` (a ``reset`` builds a
new one with the new root). It keeps the token counts of unlocked (evictable) and locked (protected) nodes and a
lazy min-heap of unlocked leaves by ``(last_access, node_id)``; the cache tells it when a leaf is added, a node is
split or touched. Eviction only removes unlocked leaves, least recently used first, so a running request's locked
prefix is never taken. Sizes are in tokens (= slots).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from raymoe.kvcache.radix_node import TreeNode, iter_nodes


class LockedLRU:
    """Lock counts and eviction order of one radix tree.

    Args:
        root: the tree's root (always locked, never evicted).
        on_evict: called with each leaf :meth:`evict` takes, before it is detached (None: nothing is called).

    Attributes:
        evictable: tokens in unlocked nodes. protected: tokens in locked nodes.
        num_nodes: nodes in the tree, the root included.
        heap: lazy min-heap of ``(last_access, node_id, node)`` for unlocked leaves; entries go stale when a node is
            touched, locked, gains a child or is evicted, and are skipped at pop time (see :meth:`is_current`).
    """

    def __init__(self, root: TreeNode, on_evict: Callable[[TreeNode], None] | None = None):
        self.root = root
        self.on_evict = on_evict
        self.evictable = 0
        self.protected = 0
        self.num_nodes = 1
        self.heap: list[tuple[int, int, TreeNode]] = []

    def added_leaf(self, leaf: TreeNode) -> None:
        """A new unlocked leaf joined the tree."""
        self.num_nodes += 1
        self.evictable += len(leaf.key)

    def added_split(self) -> None:
        """A node was cut in two (the tokens and their locks are unchanged)."""
        self.num_nodes += 1

    def touched(self, node: TreeNode) -> None:
        """``node``'s ``last_access`` changed or it is new: queue it if it is an unlocked leaf."""
        if not node.children and node.lock_ref == 0:
            self._push(node)

    def lock(self, node: TreeNode) -> None:
        """One more lock on ``node`` (in the tree, not the root) and each ancestor below the root."""
        root = self.root
        while node is not root:
            if node.lock_ref == 0:
                n = len(node.key)
                self.evictable -= n
                self.protected += n
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Release one lock of :meth:`lock` (``node.lock_ref > 0``, not the root); a leaf it frees is queued."""
        root = self.root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key)
                self.evictable += n
                self.protected -= n
                if not node.children:
                    self._push(node)
            node = node.parent

    def evict(self, num_tokens: int) -> list[int]:
        """Take least-recently-used unlocked leaves out of the tree until at least ``num_tokens`` slots are freed
        or nothing evictable remains; a parent whose last child goes becomes a leaf and a candidate itself. Whole
        nodes go, so this may free more than asked.

        Returns:
            the freed slots (the caller gives them back to the allocator).
        """
        heap = self.heap
        freed: list[int] = []
        while len(freed) < num_tokens and heap:
            stamp, _, node = heapq.heappop(heap)
            if not self.is_current(node, stamp):
                continue
            if self.on_evict is not None:
                self.on_evict(node)
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None
            self.num_nodes -= 1
            self.evictable -= len(node.value)
            freed += node.value
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    @staticmethod
    def is_current(node: TreeNode, stamp: int) -> bool:
        """Whether a heap entry ``(stamp, _, node)`` still stands for an unlocked leaf in the tree."""
        return node.parent is not None and not node.children and node.lock_ref == 0 and node.last_access == stamp

    def _push(self, node: TreeNode) -> None:
        heap = self.heap
        heapq.heappush(heap, (node.last_access, node.node_id, node))
        if len(heap) > 2 * self.num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries: keep one entry per unlocked leaf."""
        self.heap = [(n.last_access, n.node_id, n) for n in iter_nodes(self.root) if self.is_current(n, n.last_access)]
        heapq.heapify(self.heap)
