"""RankEplb: a rank's expert load balancing state: the load counter every MoE layer adds to, each layer's routing
table, and the weight mover of live rebalances (``raymoe.eplb.expert_map``, ``raymoe.eplb.weight_mover``).

The runner builds it once after the model (:meth:`RankEplb.attach`), applies each step's
:class:`~raymoe.step.expert_update.ExpertUpdate` before the forward (:meth:`RankEplb.before_step`) and, when the
update asks, copies the counter to the host with the step's tokens (:meth:`RankEplb.load_snapshot`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.eplb.expert_map import ExpertRouting
from raymoe.eplb.location import ExpertLocation
from raymoe.eplb.weight_mover import ExpertWeightMover
from raymoe.step.expert_update import ExpertUpdate


class RankEplb:
    """A rank's counter, routing tables and mover (module docstring).

    Attributes:
        counter: [L, E + 1] int64 on the rank's device: routed (token, expert) pairs per MoE layer and logical
            expert since start (the last column counts padding pairs), or None when load is not recorded.
        routings: each MoE layer's :class:`~raymoe.eplb.expert_map.ExpertRouting`, by ordinal.
        mover: the live-rebalance mover (None without ``enable_eplb``).
    """

    def __init__(self, counter: torch.Tensor | None, routings: list[ExpertRouting],
                 mover: ExpertWeightMover | None):
        self.counter = counter
        self.routings = routings
        self.mover = mover

    @classmethod
    def attach(cls, model: nn.Module, eplb, location: ExpertLocation | None, groups: ParallelGroups,
               device: torch.device) -> RankEplb | None:
        """Give every MoE block of ``model`` (a module with an ``expert_routing`` attribute, in layer order) its
        routing table and counter row; None (nothing attached) when ``location`` is None.

        Args:
            eplb: the engine's ``EplbConfig``. location: the placement the model was built with.
        Raises:
            ValueError: the model's MoE layers do not match ``location``.
        """
        if location is None:
            return None
        blocks = [m for m in model.modules() if hasattr(m, "expert_routing") and hasattr(m, "experts")]
        if len(blocks) != location.num_layers:
            raise ValueError(f"the model has {len(blocks)} MoE layers, the expert location {location.num_layers}")
        counter = (torch.zeros(location.num_layers, location.num_logical + 1, dtype=torch.int64, device=device)
                   if eplb.records_load else None)
        routings = []
        for layer, block in enumerate(blocks):
            table, counts = location.routing_table(layer)
            routing = ExpertRouting.build(table, counts, counter[layer] if counter is not None else None,
                                          groups.ep_rank, device)
            block.expert_routing = routing
            routings.append(routing)
        mover = None
        if eplb.enable_eplb:
            ranks = list(range(groups.world_size))
            group = dist.new_group(ranks=ranks)  # the transfers' own group: never queued behind a step's collectives
            mover = ExpertWeightMover([b.experts for b in blocks], routings, location, groups.ep_rank, groups.ep_size,
                                      group, ranks)
        return cls(counter, routings, mover)

    def before_step(self, update: ExpertUpdate | None) -> None:
        """The step's update before its forward: wait, commit, post (``ExpertWeightMover.apply``).

        Raises:
            ValueError: an update with weight moves on a rank built without ``enable_eplb``.
        """
        if update is None:
            return
        if self.mover is None:
            if update.transfers or update.commit is not None:
                raise ValueError("an expert rebalance reached a rank built without enable_eplb")
            return
        self.mover.apply(update)

    def load_snapshot(self) -> torch.Tensor | None:
        """A copy of the counter's expert columns, [L, E] int64 on the device (None: nothing recorded)."""
        if self.counter is None:
            return None
        return self.counter[:, :-1].clone()
