"""A Ray Serve request router that sends a request to the engine replica holding the longest prefix of its prompt,
within a load bound: the DP-group rule of ``raymoe.actors.dp_router`` one level up, across Serve replicas.

Ownership: Serve builds one :class:`PrefixAwareRequestRouter` per deployment handle (in the ingress replica that
calls the engines, ``raymoe.deploy.serve_engines``); it keeps a :class:`ReplicaPrefixIndex`. What each engine
replica caches comes from the replica itself: ``RaymoeEngine.record_routing_stats`` returns the block hashes of every
prefix its radix caches hold (``raymoe.kvcache.prefix_events``, the same hashes its driver routes DP groups by), and
Serve polls it every ``request_routing_stats_period_s`` and hands it to the routers (``RunningReplica.routing_stats``).
That report lags by up to a period, and a conversation's next turn typically arrives sooner; so the router also
counts the prompt of every request it routed as held by its replica (the replica prefills it) until a report made
after that request completed has replaced the guess with the replica's own word (evictions included).

Load is the requests this router has in flight on each replica. Decision: ``raymoe.actors.dp_router.choose_group``
(consistent hashing with bounded loads, the cached prefix in place of the hash); the chosen replica is ranked first
and the others after it, so Serve falls back to them when the chosen one is at ``max_ongoing_requests``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from raymoe.actors.dp_router import RouteDecision, choose_group
from raymoe.kvcache.prefix_events import ROUTE_BLOCK_TOKENS, block_hashes

PROMPT_KWARG = "prompt_token_ids"
"""The keyword of ``RaymoeEngine.generate`` the router reads the prompt from."""


@dataclass
class _Routed:
    """A request this router sent: its replica, its prompt's block hashes, when it completed (None: in flight)."""

    replica: str
    hashes: list[int]
    completed_at: float | None = None


@dataclass
class _Replica:
    """What the router knows of one replica: its last report (blocks, the replica's clock at the report) and the
    block counts of the prompts routed to it that no report covers yet."""

    reported: frozenset[int] = frozenset()
    reported_at: float = float("-inf")
    pending: dict[int, int] = field(default_factory=dict)
    in_flight: int = 0


class ReplicaPrefixIndex:
    """Per engine replica: the prefixes it caches (reported + routed since), its load, and the routing rule.

    Args:
        max_load_ratio: the load bound (``choose_group``), >= 1.0. block_tokens: tokens per hashed block (the
            engines' ``ROUTE_BLOCK_TOKENS``).

    Raises:
        ValueError: ``max_load_ratio < 1``.
    """

    def __init__(self, max_load_ratio: float = 1.25, block_tokens: int = ROUTE_BLOCK_TOKENS):
        if not max_load_ratio >= 1.0:
            raise ValueError(f"max_load_ratio must be >= 1.0, got {max_load_ratio}")
        self.max_load_ratio = max_load_ratio
        self.block_tokens = block_tokens
        self._replicas: dict[str, _Replica] = {}
        self._requests: dict[str, _Routed] = {}

    def _replica(self, name: str) -> _Replica:
        r = self._replicas.get(name)
        if r is None:
            r = self._replicas[name] = _Replica()
        return r

    def report(self, replica: str, blocks: Iterable[int], at: float) -> None:
        """Replica ``replica`` holds exactly ``blocks`` at its time ``at`` (seconds since the epoch). An older or
        repeated report is ignored; routed prompts of requests that completed before ``at`` stop counting."""
        r = self._replica(replica)
        if at <= r.reported_at:
            return
        r.reported, r.reported_at = frozenset(blocks), at
        for rid, routed in list(self._requests.items()):
            if routed.replica == replica and routed.completed_at is not None and routed.completed_at < at:
                self._forget(rid)

    def routed(self, request_id: str, replica: str, prompt_hashes: Sequence[int]) -> None:
        """A request with these prompt block hashes was sent to ``replica`` (again: it moves there)."""
        old = self._requests.get(request_id)
        if old is not None:
            if old.replica == replica:
                return
            if old.completed_at is None:
                self._replica(old.replica).in_flight -= 1
            self._forget(request_id)
        r = self._replica(replica)
        r.in_flight += 1
        for h in prompt_hashes:
            r.pending[h] = r.pending.get(h, 0) + 1
        self._requests[request_id] = _Routed(replica, list(prompt_hashes))

    def move(self, request_id: str, replica: str) -> None:
        """The request went to ``replica`` after all (Serve fell back to another one): count it there."""
        old = self._requests.get(request_id)
        if old is not None:
            self.routed(request_id, replica, old.hashes)

    def completed(self, request_id: str, now: float | None = None) -> None:
        """The request finished (or failed) on its replica at ``now`` (default: the current time)."""
        routed = self._requests.get(request_id)
        if routed is None or routed.completed_at is not None:
            return
        routed.completed_at = time.time() if now is None else now
        self._replica(routed.replica).in_flight -= 1

    def _forget(self, request_id: str) -> None:
        routed = self._requests.pop(request_id)
        pending = self._replica(routed.replica).pending
        for h in routed.hashes:
            n = pending[h] - 1
            if n:
                pending[h] = n
            else:
                del pending[h]

    def cached_tokens(self, replica: str, hashes: Sequence[int]) -> int:
        """Leading prompt tokens ``replica`` is taken to hold (whole blocks)."""
        r = self._replica(replica)
        k = 0
        for h in hashes:
            if h not in r.reported and h not in r.pending:
                break
            k += 1
        return k * self.block_tokens

    def load(self, replica: str) -> int:
        """Requests this router has in flight on ``replica``."""
        return self._replica(replica).in_flight

    def choose(self, replicas: Sequence[str], hashes: Sequence[int]) -> RouteDecision:
        """The bounded-load choice among ``replicas`` (non-empty) for a prompt with these block hashes; the
        decision's ``group`` indexes ``replicas``."""
        return choose_group([self.cached_tokens(r, hashes) for r in replicas], [self.load(r) for r in replicas],
                            self.max_load_ratio)

    def prune(self, live: Iterable[str]) -> None:
        """Forget replicas not in ``live`` (stopped or replaced) and their requests."""
        live = set(live)
        for name in [n for n in self._replicas if n not in live]:
            del self._replicas[name]
        for rid in [rid for rid, r in self._requests.items() if r.replica not in live]:
            del self._requests[rid]


class PrefixAwareRequestRouter(RequestRouter):
    """Serve request router for ``RaymoeEngine`` replicas (module docstring). ``request_router_kwargs``:
    ``max_load_ratio`` (default 1.25). Calls other than ``generate`` (stats, health) go to any replica."""

    def initialize_state(self, max_load_ratio: float = 1.25, **kwargs) -> None:
        self.index = ReplicaPrefixIndex(max_load_ratio)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ids = pending_request.kwargs.get(PROMPT_KWARG) if pending_request is not None else None
        if not ids or not candidate_replicas:
            return [candidate_replicas]
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            if "blocks" in stats:
                self.index.report(replica.replica_id.unique_id, stats["blocks"], float(stats.get("at", 0.0)))
        hashes = block_hashes(ids, self.index.block_tokens)
        rid = pending_request.metadata.internal_request_id
        names = [r.replica_id.unique_id for r in candidate_replicas]
        chosen = self.index.choose(names, hashes).group
        # Counted where it is sent now: Serve reports the replica it finally used (on_request_routed) only on its
        # rejection-protocol path, so this is the router's record unless that moves it.
        self.index.routed(rid, names[chosen], hashes)
        return [[candidate_replicas[chosen]], [r for i, r in enumerate(candidate_replicas) if i != chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.index.move(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.index.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.prune(r.replica_id.unique_id for r in replicas)
