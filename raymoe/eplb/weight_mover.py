"""ExpertWeightMover: a rank's side of a live rebalance (``raymoe.step.expert_update``).

Per step that carries an :class:`~raymoe.step.expert_update.ExpertUpdate`, at its start and before the forward:

1. **wait**, when the update commits a layer, for every transfer this rank posted so far (they ran in the
   background during the steps since: point-to-point sends and receives on a process group of their own, so the
   step's own collectives never queue behind them; on gloo they progress on gloo's threads, on NCCL on its
   communicator's stream); otherwise only forget the transfers that completed;
2. **commit** the update's layer: each local slot whose logical expert changes gets its staged weights copied in
   place (the tensors captured graphs read), the platform re-prepares those slots (``prepare_weight_slots``), and
   the layer's routing table switches (:meth:`~raymoe.eplb.expert_map.ExpertRouting.update`). Every rank does this
   at the same step, so no step runs a half-moved layer;
3. **post** this step's transfers: for each (layer, source slot, destination
   slot, piece) this rank sends that byte range of the source slot's tensors, or receives it (or copies it, when
   it also holds the source) into a staging buffer of the destination slot. Tensors travel as bytes (``uint8``
   views), so FP8 weights and their scales move unchanged; pieces let a copy spread over several steps.

The driver's plan (``raymoe.eplb.controller``) posts a layer's transfers at least ``COMMIT_AFTER_STEPS`` steps
before its commit, so a rank rarely waits at all. The sender's slot stays live and unchanged until its own layer
commits, which happens only after every send was waited for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from raymoe.eplb.expert_map import ExpertRouting
from raymoe.eplb.location import ExpertLocation
from raymoe.step.expert_update import ExpertTransfer, ExpertUpdate, LayerCommit


def _piece(slot: torch.Tensor, t: ExpertTransfer) -> torch.Tensor:
    """Piece ``t.piece`` of ``t.num_pieces`` equal byte ranges of one slot's contiguous tensor, as a 1-D uint8 view."""
    flat = slot.view(torch.uint8).reshape(-1)
    n = flat.numel()
    return flat[n * t.piece // t.num_pieces:n * (t.piece + 1) // t.num_pieces]


class MovableExperts(Protocol):
    """What the mover needs of one MoE layer's local experts (``raymoe.layers.moe.LocalExperts``)."""

    slot_experts: list[int]

    def slot_tensors(self) -> list[torch.Tensor]: ...

    def refresh_prepared(self, slots: Sequence[int] | None = None) -> None: ...


class ExpertWeightMover:
    """A rank's staging, sends, receives and commits of a live rebalance (module docstring).

    Args:
        experts: each MoE layer's local experts, by MoE layer ordinal. routings: each layer's routing table.
        location: the placement the ranks were loaded with (its ``max_replicas`` fixes the tables' width).
        ep_rank, ep_size: this rank's place in the EP group. group: the process group of the transfers (the EP
            ranks; a group of its own). ranks: global rank of each EP rank (``ranks[i]`` is EP rank ``i``).
    """

    def __init__(self, experts: Sequence[MovableExperts], routings: Sequence[ExpertRouting], location: ExpertLocation,
                 ep_rank: int, ep_size: int, group, ranks: Sequence[int]):
        self.experts = list(experts)
        self.routings = list(routings)
        self.location = location
        self.ep_rank = ep_rank
        self.group = group
        self.ranks = list(ranks)
        self.slots_per_rank = location.num_physical // ep_size
        self._pending: list = []
        self._staged: dict[int, dict[int, list[torch.Tensor]]] = {}  # layer -> local slot -> tensors
        self._free: list[list[torch.Tensor]] = []  # staging buffers of committed layers, reused
        self.num_commits = 0
        self.bytes_received = 0

    def apply(self, update: ExpertUpdate) -> None:
        """Before the step's forward: wait and commit, or forget completed transfers; then post this step's
        transfers (module docstring).

        Raises:
            RuntimeError: a commit finds a changed slot without staged weights (a plan that does not match the
                placement this rank holds).
        """
        if update.commit is not None:
            self.wait()
            self._commit(update.commit)
        else:
            self._pending = [w for w in self._pending if not w.is_completed()]
        if update.transfers:
            self._post(update)

    def wait(self) -> None:
        """Wait for every transfer posted so far."""
        for work in self._pending:
            work.wait()
        self._pending = []

    def _rank_of(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def _post(self, update: ExpertUpdate) -> None:
        ops: list[dist.P2POp] = []
        for i, t in enumerate(update.transfers):
            src, dst = self._rank_of(t.src_slot), self._rank_of(t.dst_slot)
            if self.ep_rank not in (src, dst):
                continue
            live = self.experts[t.layer].slot_tensors()
            sources = [_piece(x[t.src_slot - src * self.slots_per_rank], t) for x in live]
            if dst == self.ep_rank:
                layer = self._staged.setdefault(t.layer, {})
                local = t.dst_slot - dst * self.slots_per_rank
                if local not in layer:
                    layer[local] = self._staging(live)
                staged = [_piece(buf, t) for buf in layer[local]]
                if src == self.ep_rank:
                    for buf, x in zip(staged, sources, strict=True):
                        buf.copy_(x)
                    continue
                for j, buf in enumerate(staged):
                    ops.append(dist.P2POp(dist.irecv, buf, self.ranks[src], self.group, tag=i * 8 + j))
                    self.bytes_received += buf.numel()
            else:
                for j, x in enumerate(sources):
                    ops.append(dist.P2POp(dist.isend, x, self.ranks[dst], self.group, tag=i * 8 + j))
        if ops:
            self._pending.extend(dist.batch_isend_irecv(ops))

    def _staging(self, live: list[torch.Tensor]) -> list[torch.Tensor]:
        """Buffers for one slot of tensors shaped like ``live``'s slots: a freed set when one fits (a fresh
        allocation faults its pages in on the step's thread: about 1 ms per megabyte on the CI machine)."""
        shapes = [(x.shape[1:], x.dtype) for x in live]
        for i, bufs in enumerate(self._free):
            if [(b.shape, b.dtype) for b in bufs] == shapes:
                return self._free.pop(i)
        return [torch.empty_like(x[0]) for x in live]

    def _commit(self, commit: LayerCommit) -> None:
        layer = commit.layer
        experts = self.experts[layer]
        first = self.ep_rank * self.slots_per_rank
        new_slots = list(commit.physical_to_logical[first:first + self.slots_per_rank])
        staged = self._staged.pop(layer, {})
        live = experts.slot_tensors()
        changed = []
        for local, expert in enumerate(new_slots):
            if expert == experts.slot_experts[local]:
                continue
            changed.append(local)
            if local not in staged:
                raise RuntimeError(f"EPLB commit of MoE layer {layer}: local slot {local} changes from expert "
                                   f"{experts.slot_experts[local]} to {expert} but received no weights")
            for x, buf in zip(live, staged[local], strict=True):
                x[local].copy_(buf)
        self._free.extend(staged.values())
        experts.slot_experts = new_slots
        if changed:
            experts.refresh_prepared(changed)
        self.location = self.location.with_layer(layer, commit.physical_to_logical)
        self.routings[layer].update(*self.location.routing_table(layer))
        self.num_commits += 1
