"""Expert placement: which logical expert each physical expert slot of the EP group holds, from the recorded load.

The algorithm is DeepSeek's expert-parallel load balancer, described in the DeepSeek-V3 technical report
(arXiv:2412.19437, section 3.4, "redundant experts") and published as github.com/deepseek-ai/EPLB (``eplb.py``).
This is our own code of the same policy, per MoE layer:

* **hierarchical** (``num_groups % num_nodes == 0``): (1) pack the routing groups to the nodes, heaviest group first
  onto the lightest node that still has room, every node taking ``num_groups / num_nodes`` groups, so the experts of
  one group (which a group-limited router picks together) stay on one node; (2) within each node, give its
  ``num_physical / num_nodes`` slots to its experts: one each, then repeatedly one more to the expert with the
  highest load per replica; (3) pack the node's replicas (each carrying ``load / replicas``) to the node's ranks,
  heaviest first onto the lightest rank with room, every rank taking ``num_physical / num_ranks`` slots;
* **global** (otherwise): the same with one group and one node;
* (4, ours, ``refine=True``, the default) where a node's heaviest rank lies above the layer's lower bound, change
  the node's replica counts and swap replicas between its ranks while that lowers its heaviest rank
  (:func:`raymoe.eplb.placement_packing.refine_node`: why, and how much it gains). ``refine=False`` is the
  published policy alone;
* (5, ours, ``num_fault_domains > 1``) every expert keeps two replicas on two DP groups, so elastic EP can shrink
  past the loss of any one group (:mod:`raymoe.eplb.fault_spread`).

Layout: rank ``r`` holds the slots ``[r * P / num_ranks, (r + 1) * P / num_ranks)`` and node ``n`` the ranks
``[n * num_ranks / num_nodes, (n + 1) * num_ranks / num_nodes)``; within a rank, slots are in packing order
(heaviest replica first). Two replicas of one expert may share a rank (as in EPLB).

Determinism: the same input gives the same output. Every tie is broken by the lowest index (group, expert, replica,
node or rank); a replica goes, among experts of equal load per replica, to the one with fewer replicas first, so a
layer without load spreads its spare slots over the experts instead of stacking them on expert 0. The refinement's
work is counted, not timed.

Cost: plain Python over lists. L=58 layers, E=256 experts in 8 groups, P=288 slots, 32 ranks on 4 nodes, Zipf-1
load: about 14 ms for the published policy and 25 ms with the refinement on a shared 2-core CPU
(``tests/test_eplb_placement.py::test_placement_time_at_deepseek_v3_scale``, printed with ``-s``); the refinement's
work bound (``REFINE_WORK``) keeps any load under about 45 ms there (measured up to 27 ms over Zipf 0.5-1.5 loads,
global and hierarchical). The driver runs it once per rebalance; nothing
here touches a device.

Ownership: pure functions of tensors; the driver's EPLB controller calls them and owns the maps they return.
"""

from __future__ import annotations

from collections import Counter

import torch

from raymoe.eplb.fault_spread import can_spread, spread_row
from raymoe.eplb.placement_packing import (
    MIN_TRIALS,
    REFINE_TOLERANCE,
    REFINE_WORK,
    balanced_packing,
    pack_node,
    refine_node,
    replica_counts,
)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_load(weight) -> torch.Tensor:
    """``weight`` as a float64 CPU tensor [L, E], or ValueError naming ``weight``."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.size(1) < 1:
        raise ValueError(f"weight must be a tensor [num_layers, num_logical_experts >= 1], got {weight!r}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise ValueError(f"weight must hold int or float loads, got dtype {weight.dtype}")
    load = weight.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(load).all()) or bool((load < 0).any()):
        raise ValueError("weight must hold finite loads >= 0")
    return load


def _check_map(name: str, placement, num_logical: int | None = None) -> torch.Tensor:
    """``placement`` as an int64 CPU tensor [L, P] of logical ids, or ValueError naming it."""
    if not isinstance(placement, torch.Tensor) or placement.dim() != 2:
        raise ValueError(f"{name} must be a tensor [num_layers, num_physical], got {placement!r}")
    if placement.dtype.is_floating_point or placement.is_complex() or placement.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer expert ids, got dtype {placement.dtype}")
    ids = placement.detach().to("cpu", torch.int64)
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"{name} holds a negative expert id")
    if ids.numel() and num_logical is not None and int(ids.max()) >= num_logical:
        raise ValueError(f"{name} holds an expert id >= the logical experts ({num_logical})")
    return ids


def _place_layer(loads: list[float], num_physical: int, num_groups: int, num_nodes: int, num_ranks: int,
                 refine_work: int, min_replicas: int) -> list[int]:
    """One layer's physical-to-logical list [P] under the hierarchical policy (the global one is 1 group, 1 node)."""
    group_size = len(loads) // num_groups
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    slots_per_node, ranks_per_node = num_physical // num_nodes, num_ranks // num_nodes
    node_experts = [[e for g in sorted(groups) for e in range(g * group_size, (g + 1) * group_size)]
                    for groups in balanced_packing(group_loads, num_nodes)]  # step 1: groups to nodes
    # No placement of this layer beats its heaviest node's mean rank load: refining below that gains nothing.
    target = max(sum(loads[e] for e in experts) for experts in node_experts) / ranks_per_node
    target *= 1 + REFINE_TOLERANCE
    work = refine_work
    physical_to_logical: list[int] = []
    for experts in node_experts:
        node_loads = [loads[e] for e in experts]
        counts = replica_counts(node_loads, slots_per_node, min_replicas)  # step 2: replicas within the node
        packing = pack_node(node_loads, counts, ranks_per_node, swap=False)  # step 3: to the node's ranks
        if packing.peak > target and work >= MIN_TRIALS * slots_per_node:
            packing, work = refine_node(node_loads, counts, packing, ranks_per_node, target, work, min_replicas)
        for rank in packing.ranks:
            physical_to_logical.extend(experts[j] for j in rank)
    return physical_to_logical


def rebalance_experts(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                      num_ranks: int, *, refine: bool = True,
                      num_fault_domains: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A placement of the logical experts on ``num_physical`` slots that balances the per-rank load.

    Args:
        weight: [L, E] int or float, >= 0: the recorded load (tokens) per MoE layer and logical expert.
        num_physical: P, the physical expert slots of the EP group (``E + ep_num_redundant_experts``);
            P >= E and P % num_ranks == 0.
        num_groups: routing groups (DeepSeek ``n_group``; 1 when the router has none); E % num_groups == 0.
        num_nodes: nodes of the EP group; num_ranks % num_nodes == 0. The hierarchical policy applies when
            num_groups % num_nodes == 0, else the global one (module docstring).
        num_ranks: EP ranks (``ep_size``).
        refine: also run step 4 (module docstring); False gives the published policy alone.
        num_fault_domains: D, the DP groups the EP ranks form (domain d: ranks ``[d * R / D, (d + 1) * R / D)``),
            num_ranks % D == 0. Where D > 1 and P >= 2E, every expert gets two replicas or more, on two domains
            or more (:mod:`raymoe.eplb.fault_spread`), so the loss of any one DP group leaves it served; 1 (or
            P < 2E): load alone decides.

    Returns:
        physical_to_logical: [L, P] int64, the logical expert held by slot p (rank r holds the slots
            ``[r * P / num_ranks, (r + 1) * P / num_ranks)``).
        replica_count: [L, E] int64, the slots of each logical expert (>= 1; each row sums to P).

    Raises:
        ValueError: naming the argument that breaks one of the conditions above.
    """
    load = _check_load(weight)
    num_layers, num_logical = load.shape
    for name, value in (("num_physical", num_physical), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_ranks", num_ranks)):
        _positive_int(name, value)
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be >= the logical experts ({num_logical})")
    if num_physical % num_ranks:
        raise ValueError(f"num_physical ({num_physical}) must be a multiple of num_ranks ({num_ranks})")
    if num_logical % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide the logical experts ({num_logical})")
    if num_ranks % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_ranks ({num_ranks})")
    _positive_int("num_fault_domains", num_fault_domains)
    if num_ranks % num_fault_domains:
        raise ValueError(f"num_fault_domains ({num_fault_domains}) must divide num_ranks ({num_ranks})")
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # the global policy
    spread = can_spread(num_logical, num_physical, num_fault_domains)
    work = REFINE_WORK // max(num_layers, 1) if refine else 0
    rows = [_place_layer(loads, num_physical, num_groups, num_nodes, num_ranks, work, 2 if spread else 1)
            for loads in load.tolist()]
    if spread:
        rows = [spread_row(row, loads, num_ranks, num_fault_domains) for row, loads in zip(rows, load.tolist(),
                                                                                           strict=True)]
    physical_to_logical = torch.tensor(rows, dtype=torch.int64).reshape(num_layers, num_physical)
    return physical_to_logical, replica_count(physical_to_logical, num_logical)


def replica_count(physical_to_logical: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[L, E] int64: the slots of each logical expert in ``physical_to_logical`` [L, P] (ids in [0, E))."""
    ids = _check_map("physical_to_logical", physical_to_logical, _positive_int("num_logical", num_logical))
    counts = torch.zeros(ids.size(0), num_logical, dtype=torch.int64)
    return counts.scatter_add_(1, ids, torch.ones_like(ids))


def rank_loads(weight: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L, num_ranks] float64: the load each rank serves, an expert's load split evenly among its replicas.

    Args:
        weight: [L, E] int or float, >= 0 (as in :func:`rebalance_experts`).
        physical_to_logical: [L, P] integer logical ids; every expert holds at least one slot.
        num_ranks: EP ranks; P % num_ranks == 0.

    Raises:
        ValueError: naming the argument: shapes disagree, an id is out of range, an expert has no slot, or
            P % num_ranks != 0.
    """
    load = _check_load(weight)
    ids = _check_map("physical_to_logical", physical_to_logical, load.size(1))
    _positive_int("num_ranks", num_ranks)
    if ids.size(0) != load.size(0):
        raise ValueError(f"physical_to_logical has {ids.size(0)} layers, weight {load.size(0)}")
    if ids.size(1) % num_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the slots ({ids.size(1)})")
    counts = replica_count(ids, load.size(1))
    if bool((counts == 0).any()):
        raise ValueError("physical_to_logical leaves a logical expert without a slot")
    slot_load = load.gather(1, ids) / counts.gather(1, ids).to(torch.float64)
    return slot_load.view(ids.size(0), num_ranks, ids.size(1) // num_ranks).sum(-1)


def rank_balance(weight: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L] float64: per layer, the mean over the max of the per-rank load (:func:`rank_loads`); 1.0 is perfect,
    and a layer without load counts as 1.0. Arguments and errors as in :func:`rank_loads`."""
    per_rank = rank_loads(weight, physical_to_logical, num_ranks)
    peak = per_rank.max(-1).values
    return torch.where(peak > 0, per_rank.mean(-1) / peak.clamp_min(torch.finfo(torch.float64).tiny), 1.0)


def _stable_rank_slots(old: list[int], new: list[int]) -> list[int]:
    """``new`` reordered so that the most positions keep ``old``'s expert: every expert of ``new`` that ``old``
    holds at some position goes there (as many times as both hold it), the rest fill the free positions in
    ``new``'s order. This greedy matching is optimal: it keeps sum over experts of min(count in old, in new)."""
    left = Counter(new)
    out: list[int | None] = [None] * len(new)
    for pos, expert in enumerate(old):
        if left[expert] > 0:
            out[pos] = expert
            left[expert] -= 1
    rest = []
    for expert in new:
        if left[expert] > 0:
            rest.append(expert)
            left[expert] -= 1
    free = iter(rest)
    return [expert if expert is not None else next(free) for expert in out]


def keep_slots_stable(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """``new`` permuted within each rank's slot range so that the most slots keep ``old``'s expert (fewer weights
    move when a layer switches maps). Per-rank expert multisets, hence per-rank load, are those of ``new``.

    Args:
        old: [L, P] integer logical ids, the current placement.
        new: [L, P] integer logical ids, the placement to switch to.
        num_ranks: EP ranks; P % num_ranks == 0.

    Returns:
        [L, P] int64.

    Raises:
        ValueError: naming the argument: not [L, P] integer tensors of one shape, a negative id, or
            P % num_ranks != 0.
    """
    old_ids, new_ids = _check_map("old", old), _check_map("new", new)
    _positive_int("num_ranks", num_ranks)
    if old_ids.shape != new_ids.shape:
        raise ValueError(f"old {tuple(old_ids.shape)} and new {tuple(new_ids.shape)} differ in shape")
    if new_ids.size(1) % num_ranks:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the slots ({new_ids.size(1)})")
    per_rank = new_ids.size(1) // num_ranks
    rows = []
    for old_row, new_row in zip(old_ids.tolist(), new_ids.tolist(), strict=True):
        row: list[int] = []
        for start in range(0, len(new_row), per_rank):
            row.extend(_stable_rank_slots(old_row[start:start + per_rank], new_row[start:start + per_rank]))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(new_ids.shape)


def trivial_placement(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """[L, P] int64: slot p holds expert ``p % num_logical`` (the layout before any load is recorded).

    Raises:
        ValueError: naming the argument: not a positive int (num_layers may be 0), or num_physical < num_logical.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"num_layers must be an int >= 0, got {num_layers!r}")
    _positive_int("num_logical", num_logical)
    _positive_int("num_physical", num_physical)
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be >= num_logical ({num_logical})")
    return (torch.arange(num_physical, dtype=torch.int64) % num_logical).repeat(num_layers, 1)
