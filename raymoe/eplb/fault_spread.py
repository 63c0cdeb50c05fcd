"""Fault-aware expert placement: every logical expert on two fault domains, so losing one leaves it served.

A rank fault costs its whole DP-attention group (``raymoe.actors.elastic_plan``), so for the group count to
shrink instead of the world being rebuilt, each logical expert of each MoE layer needs a slot outside every single
DP group: replicas in at least two groups. EPLB's placement (:mod:`raymoe.eplb.placement`) balances load and
knows nothing of groups: it gives a cold expert one slot and may put both replicas of a hot one on one rank.

With ``num_fault_domains > 1`` the placement (1) gives every expert at least two replicas (needs ``P >= 2E``
slots; :func:`raymoe.eplb.placement_packing.replica_counts` with ``min_replicas=2``) and (2) after packing, moves
each expert whose replicas all sit in one domain (:func:`spread_row`): one of its slots swaps places with a slot
of another domain whose expert keeps a replica outside the first domain after the swap, the pair that leaves the
two ranks' heavier one lightest (ties: lowest slots). A swap keeps every rank's slot count and every expert's
replica count, never unspreads an expert, and spreads one, so at most ``E`` swaps per layer. Under the hierarchical
policy a swap may take one replica of a routing group's expert off its node (fault tolerance first; the other
replicas stay where the policy put them). Such a partner
always exists: the ``P (D - 1) / D >= E`` slots outside the domain cannot all belong to experts with only one slot
there (the expert being moved has none there).

SGLang's elastic EP (Mooncake) and vLLM's DP+EP fault-tolerance work keep serving on the surviving ranks only when
the redundant slots cover the lost ones; this is our placement-side answer, not their code.
"""

from __future__ import annotations


def can_spread(num_logical: int, num_physical: int, num_fault_domains: int) -> bool:
    """Whether every expert can hold slots in two of ``num_fault_domains`` domains (``P >= 2E`` and two domains)."""
    return num_fault_domains > 1 and num_physical >= 2 * num_logical


def spread_row(row: list[int], loads: list[float], num_ranks: int, num_fault_domains: int) -> list[int]:
    """``row`` with every expert on at least two fault domains (module docstring), changed by slot swaps.

    Args:
        row: [P] the logical expert of each physical slot (rank ``r`` holds ``[r * P / R, (r + 1) * P / R)``);
            every expert has at least two slots.
        loads: [E] tokens per logical expert; a replica carries ``load / replicas``.
        num_ranks: R, EP ranks; P % R == 0. num_fault_domains: D; R % D == 0, domain ``d`` holds the ranks
            ``[d * R / D, (d + 1) * R / D)`` (a DP group's TP ranks in the EP world's order).

    Returns: [P] the spread row.

    Raises:
        ValueError: R or D does not divide as stated, or an expert holds fewer than two slots.
    """
    num_physical = len(row)
    if num_ranks < 1 or num_physical % num_ranks or num_fault_domains < 1 or num_ranks % num_fault_domains:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the slots ({num_physical}) and be a multiple of "
                         f"num_fault_domains ({num_fault_domains})")
    count = [0] * len(loads)
    for e in row:
        count[e] += 1
    if min(count) < 2:
        raise ValueError(f"expert {count.index(min(count))} holds {min(count)} slots; spreading needs two")
    out = list(row)
    per_rank = num_physical // num_ranks
    per_domain = num_physical // num_fault_domains
    weight = [loads[e] / count[e] for e in range(len(loads))]
    rank_sum = [sum(weight[e] for e in out[r * per_rank:(r + 1) * per_rank]) for r in range(num_ranks)]
    in_domain = [[0] * num_fault_domains for _ in loads]  # [E][D] slots of each expert in each domain
    for s, e in enumerate(out):
        in_domain[e][s // per_domain] += 1
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        home = in_domain[e].index(max(in_domain[e]))
        if in_domain[e][home] < count[e]:
            continue  # already on two domains
        best = None
        for src in (s for s in range(num_physical) if out[s] == e):
            for dst in range(num_physical):
                f = out[dst]
                # f moves into home: it must keep a slot outside home besides dst
                if dst // per_domain == home or f == e or count[f] - in_domain[f][home] < 2:
                    continue
                a, b = src // per_rank, dst // per_rank
                moved = weight[e] - weight[f]
                peak = max(rank_sum[a] - moved, rank_sum[b] + moved)
                if best is None or peak < best[0]:
                    best = (peak, src, dst)
        if best is None:  # the counting argument in the module docstring rules this out
            raise AssertionError(f"no slot to spread expert {e} onto")
        _, src, dst = best
        f = out[dst]
        moved = weight[e] - weight[f]
        rank_sum[src // per_rank] -= moved
        rank_sum[dst // per_rank] += moved
        out[src], out[dst] = f, e
        far = dst // per_domain
        in_domain[e][home] -= 1
        in_domain[e][far] += 1
        in_domain[f][far] -= 1
        in_domain[f][home] += 1
    return out
