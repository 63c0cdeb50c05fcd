"""EplbController: the driver's side of expert-parallel load balancing.

Once per step the driver asks it for the step's :class:`~raymoe.step.expert_update.ExpertUpdate` (shipped inside
the ``StepDecision``, so every rank applies the same one at the same step: a decision made once, like TBO or the
graph bucket) and hands it the load counters the ranks attached to their answers.

* **Load window.** Every ``record_interval`` steps the update asks each DP group's answering rank for its
  cumulative counters; the controller turns them into per-interval deltas, sums the groups and keeps the last
  ``window_steps`` steps of them: ``window_load()`` [L, E] is what ``/metrics``, ``raymoe eplb dump`` and the next
  placement read.
* **Rebalance.** With ``enable_eplb``, ``rebalance_every`` steps after the previous move ended (or after
  :meth:`request_rebalance`) and once the window holds ``min_window_tokens`` routed tokens per layer, it computes a
  new placement from the window (``raymoe.eplb.placement.rebalance_experts``: DeepSeek's EPLB algorithm), keeps
  every slot that can keep its expert (``keep_slots_stable``), skips layers the new placement does not improve by
  ``min_balance_gain``, and plans the moves layer by layer: each changed slot receives its new expert from a slot
  that holds it now (the same rank when possible, else spread over the replicas), each copy in
  ``pieces_per_expert`` byte ranges, in chunks of at most ``experts_per_step`` pieces sent and received per rank
  and step; :data:`COMMIT_AFTER_STEPS` steps after a layer's last chunk that layer commits (its new map in the
  update) while the next layer's chunks go on. Steps never wait for a whole rebalance: each carries at most one
  chunk, which the ranks move in the background and wait for only at a commit.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch

from raymoe.eplb.location import ExpertLocation
from raymoe.eplb.placement import keep_slots_stable, rank_balance, rebalance_experts
from raymoe.eplb.report import ExpertLoadReport
from raymoe.step.expert_update import ExpertTransfer, ExpertUpdate, LayerCommit

COMMIT_AFTER_STEPS = 2
"""A layer commits this many steps after its last transfer was posted (the next layer's transfers go on
meanwhile): the ranks wait for their transfers only at a commit, by when they have had whole steps to finish in the
background."""


def ep_node_count(node_ids: Sequence[str]) -> int:
    """Nodes the hierarchical placement may assume for EP ranks on ``node_ids`` (rank order): their number when
    each node holds one contiguous, equal-sized block of ranks (node-ordered GPU ranks, ``raymoe.cluster.rank_plan``),
    else 1 (the placement then treats the group as one node)."""
    blocks: list[str] = []
    for node in node_ids:
        if not blocks or blocks[-1] != node:
            blocks.append(node)
    if len(set(blocks)) != len(blocks) or not node_ids or len(node_ids) % len(blocks):
        return 1
    size = len(node_ids) // len(blocks)
    return len(blocks) if all(node_ids[i] == node_ids[i - i % size] for i in range(len(node_ids))) else 1


class EplbController:
    """The driver's expert-load window and rebalance planner (module docstring).

    Args:
        location: the placement the ranks were loaded with. ep_size: EP ranks. enable_eplb: rebalance while
            serving. record_interval, window_steps, rebalance_every: steps (``EplbConfig``). min_window_tokens:
            routed pairs per layer a rebalance needs. experts_per_step: most expert copies a rank sends or receives
            per step. num_groups: routing groups of the model (DeepSeek ``n_group``; 1 without). num_nodes: nodes
            the EP ranks span (rank ``r`` on node ``r * num_nodes // ep_size``). pieces_per_expert: byte ranges of
            one expert copy. min_balance_gain: an automatic rebalance moves a layer only when the new placement
            raises its balance (mean / max per-rank load over the window) by at least this much (no churn between
            placements that are about as good). fault_domain_ranks: with elastic EP, the EP ranks of one DP group
            (``tp_size``): a rebalance keeps every expert on two DP groups where the slots allow
            (``rebalance_experts(num_fault_domains=ep_size // fault_domain_ranks)``), so a rank fault can still
            shrink the world; 0: load alone decides.
    Attributes:
        location: the placement the ranks hold (a committed layer counts from the step that commits it).
        num_rebalances: rebalances planned. num_layer_commits: layers switched.
    """

    def __init__(self, location: ExpertLocation, ep_size: int, enable_eplb: bool, record_interval: int,
                 window_steps: int, rebalance_every: int, min_window_tokens: int, experts_per_step: int,
                 num_groups: int = 1, num_nodes: int = 1, pieces_per_expert: int = 1,
                 min_balance_gain: float = 0.0, fault_domain_ranks: int = 0):
        self.initial = self.location = location
        self.initial_ep_size = self.ep_size = ep_size
        self.enable_eplb = enable_eplb
        self.record_interval = record_interval
        self.window_steps = window_steps
        self.rebalance_every = rebalance_every
        self.min_window_tokens = min_window_tokens
        self.experts_per_step = experts_per_step
        self.pieces_per_expert = pieces_per_expert
        self.min_balance_gain = min_balance_gain
        self.num_groups = num_groups
        self.num_nodes = num_nodes
        self.fault_domain_ranks = fault_domain_ranks
        self._steps = 0
        self._since_report = 0
        self._since_rebalance = 0
        self._requested = False
        self._actions: deque[ExpertUpdate] = deque()
        self._last: dict[int, torch.Tensor] = {}
        self._window: deque[torch.Tensor] = deque()
        self._window_lock = threading.Lock()
        self.num_rebalances = 0
        self.num_layer_commits = 0

    # ---- per step ----
    def next_update(self) -> ExpertUpdate | None:
        """The update of the step being decided (None: nothing for the ranks to do)."""
        self._steps += 1
        self._since_report += 1
        if not self._actions:  # the period counts from the end of the last move
            self._since_rebalance += 1
        report = self._since_report >= self.record_interval
        if report:
            self._since_report = 0
        if not self._actions and self.enable_eplb and self.ep_size > 1 and (self._requested or
                                                       self._since_rebalance >= self.rebalance_every):
            self._plan()
        update = self._actions.popleft() if self._actions else ExpertUpdate()
        if update.commit is not None:
            self.location = self.location.with_layer(update.commit.layer, update.commit.physical_to_logical)
            self.num_layer_commits += 1
        if report:
            update = ExpertUpdate(update.transfers, update.commit, report_load=True)
        return None if update.empty else update

    def record(self, loads: Sequence[list[int] | None]) -> None:
        """Take the cumulative counters each DP group's answering rank attached to a step (None: that group
        attached none). Deltas since each group's previous report join the window."""
        shape = (self.location.num_layers, self.location.num_logical)
        total = None
        for group, flat in enumerate(loads):
            if flat is None:
                continue
            cur = torch.tensor(flat, dtype=torch.int64).view(shape)
            last = self._last.get(group)
            delta = cur if last is None or bool((cur < last).any()) else cur - last  # counters restart with ranks
            self._last[group] = cur
            total = delta if total is None else total + delta
        if total is None:
            return
        with self._window_lock:  # /metrics reads the window from another thread
            self._window.append(total)
            while len(self._window) * self.record_interval > self.window_steps:
                self._window.popleft()

    # ---- reads ----
    def window_load(self) -> torch.Tensor:
        """[L, E] int64: routed pairs per MoE layer and logical expert over the window."""
        with self._window_lock:
            parts = list(self._window)
        if not parts:
            return torch.zeros(self.location.num_layers, self.location.num_logical, dtype=torch.int64)
        return torch.stack(parts).sum(dim=0)

    def balance(self) -> list[float]:
        """Per MoE layer, mean / max of per-rank load over the window under the current placement (1.0 = even)."""
        p2l = torch.tensor(self.location.physical_to_logical, dtype=torch.int64)
        return [float(x) for x in rank_balance(self.window_load(), p2l, self.ep_size)]

    def report(self) -> ExpertLoadReport:
        """The window, the balance and the placement as plain data (``/metrics``, ``raymoe eplb dump``)."""
        return ExpertLoadReport(self.location.num_logical, self.ep_size,
                                min(len(self._window) * self.record_interval, self.window_steps),
                                self.window_load().tolist(), self.balance(),
                                [list(r) for r in self.location.physical_to_logical], self.num_rebalances,
                                self.num_layer_commits, self.moving)

    @property
    def moving(self) -> bool:
        """A rebalance's moves or commits are still to be sent."""
        return bool(self._actions)

    # ---- control ----
    def request_rebalance(self) -> None:
        """Plan a rebalance at the next step (if the window holds enough load and none is in progress)."""
        self._requested = True

    def abort(self) -> None:
        """Drop the moves not sent yet (the driver reset its groups); layers already committed stay switched."""
        self._actions.clear()

    def ranks_restarted(self) -> None:
        """The ranks were rebuilt from the initial placement: forget moves, counters and the committed layers."""
        self.ranks_reformed(self.initial, self.initial_ep_size)

    def ranks_reformed(self, location: ExpertLocation, ep_size: int) -> None:
        """The ranks were rebuilt over ``ep_size`` ranks holding ``location`` (an elastic shrink or grow,
        ``raymoe.actors.elastic_world``; a restart returns to the initial ones): forget moves and counters."""
        self._actions.clear()
        self._last.clear()
        self.location, self.ep_size = location, ep_size

    # ---- planning ----
    def _plan(self) -> None:
        self._since_rebalance = 0
        load = self.window_load()
        if int(load.sum(dim=1).min()) < self.min_window_tokens:
            return
        requested, self._requested = self._requested, False
        old = torch.tensor(self.location.physical_to_logical, dtype=torch.int64)
        domains = self.ep_size // self.fault_domain_ranks if self.fault_domain_ranks else 1
        new, _ = rebalance_experts(load, self.location.num_physical, self.num_groups, self.num_nodes, self.ep_size,
                                   num_fault_domains=domains)
        new = keep_slots_stable(old, new, self.ep_size)
        gain = rank_balance(load, new, self.ep_size) - rank_balance(load, old, self.ep_size)
        need = 1e-9 if requested else self.min_balance_gain  # an asked-for rebalance moves any layer it improves
        self.num_rebalances += 1
        transfers: list[list[ExpertTransfer]] = []  # per step of the move
        commits: list[LayerCommit | None] = []
        last_commit = -1
        for layer in range(self.location.num_layers):
            old_row, new_row = old[layer].tolist(), new[layer].tolist()
            if old_row == new_row or float(gain[layer]) < need:
                continue
            for chunk in self._chunks(layer, old_row, new_row):
                transfers.append(chunk)
                commits.append(None)
            at = max(len(transfers) - 1 + COMMIT_AFTER_STEPS, last_commit + 1)
            while len(commits) <= at:
                transfers.append([])
                commits.append(None)
            commits[at] = LayerCommit(layer, tuple(new_row))
            last_commit = at
        self._actions.extend(ExpertUpdate(tuple(t), c) for t, c in zip(transfers, commits, strict=True))

    def _chunks(self, layer: int, old_row: list[int], new_row: list[int]) -> list[list[ExpertTransfer]]:
        """The transfers that turn ``old_row`` into ``new_row`` (each copy in ``pieces_per_expert`` pieces, in
        order), grouped so each rank sends and receives at most ``experts_per_step`` pieces per chunk (first fit: a
        later piece of a copy never lands in an earlier chunk than the one before it)."""
        per_rank = len(old_row) // self.ep_size
        holders: dict[int, list[int]] = {}
        for slot, e in enumerate(old_row):
            holders.setdefault(e, []).append(slot)
        sends = [0] * self.ep_size  # over the whole layer: spread the sources over the replicas
        transfers = []
        for slot, e in enumerate(new_row):
            if old_row[slot] == e:
                continue
            rank = slot // per_rank
            local = [s for s in holders[e] if s // per_rank == rank]
            src = local[0] if local else min(holders[e], key=lambda s: (sends[s // per_rank], s))
            sends[src // per_rank] += src // per_rank != rank
            transfers.extend(ExpertTransfer(layer, src, slot, piece, self.pieces_per_expert)
                             for piece in range(self.pieces_per_expert))
        chunks: list[list[ExpertTransfer]] = []
        loads: list[tuple[list[int], list[int]]] = []
        for t in transfers:
            s, d = t.src_slot // per_rank, t.dst_slot // per_rank
            for chunk, (out, inn) in zip(chunks, loads, strict=True):
                if out[s] < self.experts_per_step and inn[d] < self.experts_per_step:
                    chunk.append(t)
                    out[s] += 1
                    inn[d] += 1
                    break
            else:
                out, inn = [0] * self.ep_size, [0] * self.ep_size
                out[s] += 1
                inn[d] += 1
                chunks.append([t])
                loads.append((out, inn))
        return chunks
