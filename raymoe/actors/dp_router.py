"""Routing a new request to a DP-attention group: the group that holds its longest cached prefix, within a load
bound, else the least loaded one.

Ownership: one :class:`DpRouter` per driver (``raymoe.actors.driver`` and ``raymoe.actors.hosted_driver`` both).
It keeps an index of which token blocks each group's radix tree holds, fed by the groups' block-hash deltas
(``raymoe.kvcache.prefix_events``: exact to the block, whether a group's scheduler runs in the driver's process or
its own), and the routing counters ``/metrics`` shows.

Why a bound: the DP groups step in lockstep (every rank enters every MoE collective), so a step lasts as long as
its busiest group; piling requests onto the group that caches a popular prefix (a shared system prompt) would slow
every group. The rule is consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018, "Consistent
Hashing with Bounded Loads"), with the cached prefix in place of the hash: a group may take the request only while
its load after taking it stays within ``max_load_ratio`` times the mean load (rounded up, so the least loaded group
always may); among the groups that may, the longest cached prefix wins, ties go to the least loaded, then the lowest
index. Load is requests (running + waiting + routed but not yet seen by the group).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.kvcache.prefix_events import ROUTE_BLOCK_TOKENS, PrefixDelta, block_hashes

ROUTE_METHODS = ("prefix_aware", "shortest_queue")


@dataclass(frozen=True)
class RouteDecision:
    """Where one request went and why.

    Attributes:
        group: the DP group index. reason: ``"prefix"`` (the chosen group holds part of the prompt) or ``"load"``.
        expected_cached_tokens: prompt tokens the chosen group held when it was chosen (whole blocks).
        best_cached_tokens: the longest cached prefix over all groups (more than expected: the load bound said no).
    """

    group: int
    reason: str
    expected_cached_tokens: int
    best_cached_tokens: int


@dataclass(frozen=True)
class RouteCounters:
    """Routing counters since the engine started (``EngineStats.routing``).

    Attributes:
        by_prefix, by_load: requests routed for a cached prefix / by load alone. capped: requests whose longest
        cached prefix lay on a group over the load bound. expected_cached_tokens: prompt tokens the chosen groups
        held at routing (compare with ``radix_hit_tokens``: prefixes can be evicted before admission).
    """

    by_prefix: int = 0
    by_load: int = 0
    capped: int = 0
    expected_cached_tokens: int = 0


class DpRouter:
    """Picks the DP group of each new request (module docstring).

    Args:
        dp_size: number of groups (>= 1). method: one of :data:`ROUTE_METHODS` (``shortest_queue``: load only).
        max_load_ratio: the load bound, a multiple of the mean load (>= 1.0).
        block_tokens: tokens per hashed block (the groups' logs must use the same).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, dp_size: int, method: str = "prefix_aware", max_load_ratio: float = 1.25,
                 block_tokens: int = ROUTE_BLOCK_TOKENS):
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if method not in ROUTE_METHODS:
            raise ValueError(f"method must be one of {ROUTE_METHODS}, got {method!r}")
        if not max_load_ratio >= 1.0:
            raise ValueError(f"max_load_ratio must be >= 1.0, got {max_load_ratio}")
        self.dp_size = dp_size
        self.method = method
        self.max_load_ratio = max_load_ratio
        self.block_tokens = block_tokens
        self._held: list[set[int]] = [set() for _ in range(dp_size)]
        self._lock = threading.Lock()  # the index is read by other threads (held_blocks)
        self._counters = RouteCounters()

    @property
    def uses_prefixes(self) -> bool:
        """Whether the groups must report their trees (prefix routing over more than one group)."""
        return self.method == "prefix_aware" and self.dp_size > 1

    @property
    def counters(self) -> RouteCounters:
        return self._counters

    def apply(self, group: int, delta: PrefixDelta | None) -> None:
        """Fold one group's tree delta into the index (None: no change)."""
        if delta is None:
            return
        held = self._held[group]
        with self._lock:
            if delta.cleared:
                held.clear()
            held.difference_update(delta.removed)
            held.update(delta.stored)

    def clear(self) -> None:
        """Forget every group's tree (the groups were reset)."""
        with self._lock:
            for held in self._held:
                held.clear()

    def held_blocks(self) -> list[int]:
        """Every block hash some group's tree holds (the engine's cached prefixes, for a router in front of several
        engines: ``raymoe.deploy.serve_router``). Safe to call from any thread; O(cached blocks)."""
        with self._lock:
            return list(set().union(*self._held))

    def cached_tokens(self, input_ids: Sequence[int]) -> list[int]:
        """Per group, the leading tokens of ``input_ids`` its tree holds, in whole blocks (O(len(input_ids)))."""
        if not self.uses_prefixes:
            return [0] * self.dp_size
        hashes = block_hashes(input_ids, self.block_tokens)
        out = []
        for held in self._held:
            k = 0
            for h in hashes:
                if h not in held:
                    break
                k += 1
            out.append(k * self.block_tokens)
        return out

    def route(self, input_ids: Sequence[int], loads: Sequence[int]) -> RouteDecision:
        """Choose the group of a request with prompt ``input_ids`` given each group's load (requests), and count
        the decision."""
        cached = self.cached_tokens(input_ids)
        decision = choose_group(cached, loads, self.max_load_ratio)
        c = self._counters
        self._counters = RouteCounters(
            by_prefix=c.by_prefix + (decision.reason == "prefix"), by_load=c.by_load + (decision.reason == "load"),
            capped=c.capped + (decision.best_cached_tokens > decision.expected_cached_tokens),
            expected_cached_tokens=c.expected_cached_tokens + decision.expected_cached_tokens)
        return decision


def choose_group(cached: Sequence[int], loads: Sequence[int], max_load_ratio: float) -> RouteDecision:
    """The bounded-load rule (module docstring): the group to take a request, from each group's cached prefix
    length (tokens) and load (requests, before this one).

    Raises:
        ValueError: ``cached`` and ``loads`` differ in length or are empty.
    """
    if len(cached) != len(loads) or not loads:
        raise ValueError(f"choose_group: {len(cached)} cached lengths for {len(loads)} loads")
    cap = max(math.ceil(max_load_ratio * (sum(loads) + 1) / len(loads)), min(loads) + 1)
    best = max(cached)
    group = min((g for g in range(len(loads)) if loads[g] + 1 <= cap), key=lambda g: (-cached[g], loads[g], g))
    return RouteDecision(group, "prefix" if cached[group] > 0 else "load", cached[group], best)
