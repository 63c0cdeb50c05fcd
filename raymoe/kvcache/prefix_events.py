"""Which token blocks a radix tree holds, as a stream of stored / removed block hashes for a router elsewhere.

Ownership: a :class:`PrefixEventLog` is attached to one DP group's ``RadixCache`` (``RadixCache.record_events``)
when the driver routes by prefix; the cache reports every path it inserts and every leaf it evicts, the log turns
them into hashes of whole blocks of ``block_tokens`` tokens, and the group's owner drains it into a
:class:`PrefixDelta` after each step. The driver applies the deltas to its index of every group
(``raymoe.actors.dp_router``), which then answers "how many leading tokens of this prompt does group g hold" exactly
to the block, without holding the trees themselves or a copy of their tokens.

Hashes are chained (block k's hash covers blocks 0..k), so a block hash names a whole prefix, and a tree holds
block k of a path exactly when it holds the path's first ``(k + 1) * block_tokens`` tokens: a set of hashes per
group is enough. This is the block-hash form of KV-cache events that vLLM's prefix caching and the KV-aware routers
built on it (Dynamo, llm-d) use; the radix tree itself is SGLang's RadixAttention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROUTE_BLOCK_TOKENS = 16
"""Tokens per hashed block: cached prefixes are counted in whole blocks of this many tokens."""

_ROOT_HASH = 0x5EED


def block_hashes(token_ids: Sequence[int], block_tokens: int = ROUTE_BLOCK_TOKENS, num_blocks: int | None = None
                 ) -> list[int]:
    """Chained hashes of the whole blocks of ``token_ids``: entry k hashes tokens ``[0, (k + 1) * block_tokens)``.

    Deterministic across processes (hashes of ints and tuples of ints are not salted). Cost: O(len(token_ids)).

    Args:
        token_ids: a token path from the root (a prompt, or a cached sequence).
        block_tokens: tokens per block (> 0).
        num_blocks: hash at most this many leading blocks (None: every whole block).
    """
    n = len(token_ids) // block_tokens
    if num_blocks is not None:
        n = min(n, num_blocks)
    out: list[int] = []
    h = _ROOT_HASH
    ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids[: n * block_tokens])
    for k in range(n):
        h = hash((h, ids[k * block_tokens : (k + 1) * block_tokens]))
        out.append(h)
    return out


@dataclass(frozen=True)
class PrefixDelta:
    """What one group's radix tree gained and lost since the last drain (net: ``stored`` and ``removed`` are
    disjoint, so the order of applying them does not matter).

    Attributes:
        cleared: the tree was emptied first (a reset); apply before ``stored``.
        stored: hashes of blocks the tree holds now and may not have held before.
        removed: hashes of blocks the tree no longer holds.
    """

    cleared: bool = False
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


class PrefixEventLog:
    """Collects the block hashes a radix tree stores and removes until :meth:`drain`.

    Args:
        block_tokens: tokens per block (> 0).

    Raises:
        ValueError: ``block_tokens < 1``.
    """

    def __init__(self, block_tokens: int = ROUTE_BLOCK_TOKENS):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._cleared = False
        self._stored: set[int] = set()
        self._removed: set[int] = set()

    def _ending_past(self, path: Sequence[int], start: int) -> list[int]:
        """Hashes of the whole blocks of ``path`` that end past token ``start`` (block ``start // block_tokens``
        is the first: its end is the first past ``start``)."""
        return block_hashes(path, self.block_tokens)[start // self.block_tokens:]

    def stored(self, path: Sequence[int], start: int) -> None:
        """The tree now holds ``path`` (token ids from the root), of which tokens ``[start, len(path))`` are new:
        every block ending past ``start`` is recorded as stored."""
        for h in self._ending_past(path, start):
            self._removed.discard(h)
            self._stored.add(h)

    def removed(self, path: Sequence[int], start: int) -> None:
        """The tree dropped tokens ``[start, len(path))`` of ``path`` (an evicted leaf): every block ending past
        ``start`` is recorded as removed."""
        for h in self._ending_past(path, start):
            self._stored.discard(h)
            self._removed.add(h)

    def cleared(self) -> None:
        """The tree was emptied (``RadixCache.reset``)."""
        self._cleared = True
        self._stored.clear()
        self._removed.clear()

    def drain(self) -> PrefixDelta | None:
        """The net change since the last drain, or None when there is none."""
        if not (self._cleared or self._stored or self._removed):
            return None
        delta = PrefixDelta(self._cleared, tuple(self._stored), tuple(self._removed))
        self._cleared = False
        self._stored = set()
        self._removed = set()
        return delta
