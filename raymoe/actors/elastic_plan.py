"""Elastic expert parallelism: which ranks a rank group can keep serving on after some of its ranks were lost.

A rank fault costs its whole DP-attention group (the group's KV and requests lived on all of its TP ranks), so the
survivors are the ranks of the DP groups that lost none. They can serve alone when every logical expert of every
MoE layer still has a slot on one of them: with experts sharded over the world (``ep_size > 1``) that needs
redundant slots (``ep_num_redundant_experts``, ``raymoe.eplb``) placed so each expert lives on two ranks; with
experts tensor-parallel inside each DP group (``ep_size == 1``) every group holds every expert already. The
survivors keep their slots: the new world's slot ``j`` on new rank ``r`` is the slot its rank held before, so the
new placement is the old one with the lost ranks' slot ranges cut out (``ExpertLocation``'s layout: rank ``r``
holds slots ``[r * P / ep, (r + 1) * P / ep)``).

Mooncake's elastic EP in SGLang and the DP+EP fault-tolerance RFC of vLLM ask the same question of the same
layout; this module answers it as plain data, and ``RayExecutor.shrink`` acts on the answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from raymoe.config import ParallelConfig
from raymoe.eplb.location import ExpertLocation


class CannotShrink(ValueError):
    """The survivors of a fault cannot serve alone (the message says why); the group is rebuilt instead."""


@dataclass(frozen=True)
class ShrinkPlan:
    """The world a rank group continues in after a fault.

    Attributes:
        parallel: the survivors' layout (same ``tp_size``, fewer DP groups; ``ep_size`` the new world or 1).
        survivors: the old rank index of each new rank, in new rank order (ascending).
        lost_groups: the old DP groups dropped, ascending.
        location: the survivors' expert placement (their slots, in new rank order), or None where the ranks
            run without one (trivial placement with ``ep_size == 1``).
    """

    parallel: ParallelConfig
    survivors: tuple[int, ...]
    lost_groups: tuple[int, ...]
    location: ExpertLocation | None

    def __post_init__(self) -> None:
        if len(self.survivors) != self.parallel.world_size:
            raise ValueError(f"ShrinkPlan.survivors: {len(self.survivors)} ranks for a world of "
                             f"{self.parallel.world_size}")
        if list(self.survivors) != sorted(set(self.survivors)):
            raise ValueError("ShrinkPlan.survivors must be distinct and ascending")


def plan_shrink(parallel: ParallelConfig, location: ExpertLocation | None, lost_ranks: Iterable[int]) -> ShrinkPlan:
    """The world the ranks outside the lost ranks' DP groups continue in.

    Args:
        parallel: the layout at the fault. location: the placement the ranks hold (None: every rank holds
            ``E / ep_size`` experts, one slot each). lost_ranks: ranks that died or stopped answering.
    Raises:
        CannotShrink: no rank was lost, every DP group lost a rank, or some logical expert of some layer has no
            slot on a survivor (names the layer and the expert).
        ValueError: a lost rank outside the world.
    """
    lost = sorted(set(lost_ranks))
    if not lost:
        raise CannotShrink("no rank was lost")
    if lost[0] < 0 or lost[-1] >= parallel.world_size:
        raise ValueError(f"lost ranks {lost} outside the world of {parallel.world_size}")
    tp = parallel.tp_size
    lost_groups = tuple(sorted({r // tp for r in lost}))
    dp = parallel.dp_size - len(lost_groups)
    if dp == 0:
        raise CannotShrink(f"every DP group lost a rank (ranks {lost} of {parallel.world_size})")
    survivors = tuple(r for r in range(parallel.world_size) if r // tp not in lost_groups)
    world = dp * tp
    new_parallel = ParallelConfig(tp_size=tp, dp_size=dp, ep_size=world if parallel.ep_size > 1 else 1,
                                  bundle_gpus=parallel.bundle_gpus)
    if parallel.ep_size == 1:  # experts tensor-parallel inside each group: every group holds all of them
        return ShrinkPlan(new_parallel, survivors, lost_groups, location)
    if location is None:
        raise CannotShrink("no redundant experts: each expert lives on one rank only "
                           "(ep_num_redundant_experts places replicas)")
    per_rank = location.num_physical // parallel.world_size
    rows = []
    for layer, row in enumerate(location.physical_to_logical):
        kept = tuple(row[s] for r in survivors for s in range(r * per_rank, (r + 1) * per_rank))
        missing = sorted(set(range(location.num_logical)) - set(kept))
        if missing:
            raise CannotShrink(f"MoE layer {layer}: expert {missing[0]} has no slot on a surviving rank "
                               f"({len(missing)} experts of that layer lived only on the lost ranks)")
        rows.append(kept)
    return ShrinkPlan(new_parallel, survivors, lost_groups, ExpertLocation(location.num_logical, tuple(rows)))


def fault_tolerant(parallel: ParallelConfig, location: ExpertLocation | None) -> bool:
    """Whether the loss of any one rank leaves a world that can serve (:func:`plan_shrink` succeeds for each)."""
    if parallel.dp_size < 2:
        return False
    for rank in range(parallel.world_size):
        try:
            plan_shrink(parallel, location, [rank])
        except CannotShrink:
            return False
    return True
