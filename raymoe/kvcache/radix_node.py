"""The records of the radix cache's tree: an edge (:class:`TreeNode`), a match (:class:`MatchResult`), and the
walks over them that need no cache state.

Ownership: nodes are created, split and dropped by ``raymoe.kvcache.radix_cache.RadixCache``; their lock counts and
LRU stamps are kept by ``raymoe.kvcache.radix_lru.LockedLRU``. Plain Python throughout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class TreeNode:
    """One edge of the radix tree: a run of tokens and the KV slots holding them.

    Attributes:
        children: child nodes keyed by the first token id of their ``key``.
        parent: parent node; ``None`` for the root and for nodes that were evicted or dropped by ``reset``.
        key: token ids of this edge (empty only for the root).
        value: KV slots of those tokens, ``len(value) == len(key)``.
        lock_ref: number of locks held on this node or its descendants (> 0: protected from eviction).
        last_access: logical clock of the last match/insert through this node (a counter, not wall time).
        node_id: creation number, breaks LRU ties deterministically.
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "node_id")

    def __init__(self, key: list[int], value: list[int], parent: TreeNode | None, node_id: int, last_access: int):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = node_id

    def __repr__(self) -> str:
        return f"TreeNode(id={self.node_id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """Outcome of :meth:`RadixCache.match_prefix`.

    Attributes:
        slots: KV slots of the longest cached prefix (one per matched token; a fresh list the caller may keep).
        last_node: node where the match ends (the root for an empty match). Lock it with ``inc_lock_ref`` while
            the request uses the prefix, and unlock it with ``dec_lock_ref`` when done.
    """

    slots: list[int]
    last_node: TreeNode


def common_prefix_len(key: list[int], ids: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``key`` and ``ids[start:]``."""
    seg = ids[start : start + len(key)]
    for n, (a, b) in enumerate(zip(key, seg, strict=False)):
        if a != b:
            return n
    return len(seg)


def iter_nodes(root: TreeNode) -> Iterator[TreeNode]:
    """Every node below ``root`` and ``root`` itself, depth first (O(tree))."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def format_tree(root: TreeNode, header: str) -> str:
    """Indented dump below ``header``: key (first tokens), token count, lock count and last access per node."""
    lines = [header]

    def visit(node: TreeNode, depth: int) -> None:
        for tok in sorted(node.children):
            child = node.children[tok]
            key = " ".join(map(str, child.key[:8])) + (" ..." if len(child.key) > 8 else "")
            lines.append(f"{'  ' * depth}[{key}] tokens={len(child.key)} lock={child.lock_ref} t={child.last_access}")
            visit(child, depth + 1)

    visit(root, 1)
    return "\n".join(lines)
