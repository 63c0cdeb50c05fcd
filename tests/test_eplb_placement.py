"""Tests of the expert placement (``raymoe.eplb.placement``): balance against a brute-force optimum on small cases,
the published EPLB policy on an example computed with its code, the invariants every placement keeps (property
tests), groups kept on one node, the stable reordering of slots, the balance figure, and refused arguments."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.eplb.placement import (
    keep_slots_stable,
    rank_balance,
    rank_loads,
    rebalance_experts,
    replica_count,
    trivial_placement,
)


def zipf_load(num_experts: int, exponent: float, seed: int, tokens: float = 1000.0) -> torch.Tensor:
    """[E] float64: whole-token loads ``tokens / rank**exponent`` in a seeded random expert order (a router whose
    few hot experts take most tokens)."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    return (tokens / ranks**exponent)[order].round()


def compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive ints (replica counts of ``parts`` experts)."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def best_split(items: list[float], num_ranks: int) -> float:
    """The least heaviest-rank load over every split of ``items`` into ``num_ranks`` ranks of equal item count."""
    per_rank = len(items) // num_ranks
    best = float("inf")

    def split(left: list[int], peak: float) -> None:
        nonlocal best
        if peak >= best:
            return
        if not left:
            best = peak
            return
        first, rest = left[0], left[1:]
        for others in itertools.combinations(range(len(rest)), per_rank - 1):
            load = items[first] + sum(items[rest[i]] for i in others)
            split([x for i, x in enumerate(rest) if i not in others], max(peak, load))

    split(list(range(len(items))), 0.0)
    return best


def brute_force_peak(load: list[float], num_physical: int, num_ranks: int) -> float:
    """The optimal heaviest-rank load over every replica count and every equal-slot split to ranks."""
    return min(best_split([w / c for w, c in zip(load, counts, strict=True) for _ in range(c)], num_ranks)
               for counts in compositions(num_physical, len(load)))


def peak(weight: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    return rank_loads(weight, physical_to_logical, num_ranks).max(-1).values


@pytest.mark.parametrize(("num_logical", "num_physical", "num_ranks"),
                         [(3, 6, 3), (4, 6, 2), (4, 6, 3), (4, 8, 4), (5, 6, 2), (5, 6, 3), (5, 8, 2), (5, 8, 4),
                          (6, 8, 2)])
def test_balance_within_5_percent_of_the_brute_force_optimum(num_logical, num_physical, num_ranks):
    for exponent, seed in itertools.product((0.5, 1.0, 1.5, 2.0, 3.0), (0, 1)):
        load = zipf_load(num_logical, exponent, seed)
        physical_to_logical, _ = rebalance_experts(load[None], num_physical, 1, 1, num_ranks)
        optimum = brute_force_peak(load.tolist(), num_physical, num_ranks)
        balance = float(rank_balance(load[None], physical_to_logical, num_ranks)[0])
        best_balance = float(load.sum()) / num_ranks / optimum
        assert balance >= 0.95 * best_balance, (exponent, seed, balance, best_balance)


def test_refinement_beats_the_published_policy_where_heavy_replicas_share_a_rank():
    # 4 experts, 8 slots, 4 ranks of 2: EPLB's counts 5/1/1/1 put two replicas of 200 on one rank (400); the optimum
    # gives the hot expert one replica per rank and the next expert two (312.5).
    load = torch.tensor([[1000.0, 125.0, 37.0, 16.0]])
    published, published_counts = rebalance_experts(load, 8, 1, 1, 4, refine=False)
    refined, refined_counts = rebalance_experts(load, 8, 1, 1, 4)
    assert published_counts.tolist() == [[5, 1, 1, 1]] and float(peak(load, published, 4)[0]) == 400.0
    assert refined_counts.tolist() == [[4, 2, 1, 1]] and float(peak(load, refined, 4)[0]) == 312.5
    assert brute_force_peak(load[0].tolist(), 8, 4) == 312.5


def test_published_policy_matches_deepseek_eplb():
    # Expected values computed by running deepseek-ai/EPLB eplb.py (commit 5791971) on these 2 layers x 12 experts,
    # 4 groups, 2 nodes, 8 GPUs. Layer 1 holds a tie (experts 8 and 9 carry 86 tokens per replica), which the two
    # codes break differently: its per-rank loads and replica counts agree, the slot order need not.
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 22, 9],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    physical_to_logical, counts = rebalance_experts(weight, 16, 4, 2, 8, refine=False)
    assert physical_to_logical[0].tolist() == [5, 10, 5, 11, 3, 4, 9, 4, 8, 7, 1, 2, 1, 6, 0, 0]
    assert counts.tolist() == [[2, 2, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert rank_loads(weight, physical_to_logical, 8).tolist() == [
        [104.5, 91.5, 113.0, 108.0, 77.0, 106.0, 105.0, 90.0],
        [173.0, 179.5, 120.5, 172.0, 123.0, 152.0, 118.5, 117.5]]


def check_placement(weight, physical_to_logical, counts, num_physical, num_groups, num_nodes, num_ranks):
    """Every invariant of a placement (the shapes and layout of ``rebalance_experts``'s docstring)."""
    num_layers, num_logical = weight.shape
    assert physical_to_logical.shape == (num_layers, num_physical) and physical_to_logical.dtype == torch.int64
    assert counts.shape == (num_layers, num_logical) and counts.dtype == torch.int64
    assert bool(((physical_to_logical >= 0) & (physical_to_logical < num_logical)).all())
    for layer in range(num_layers):
        assert torch.equal(torch.bincount(physical_to_logical[layer], minlength=num_logical), counts[layer])
    assert bool((counts >= 1).all()) and counts.sum(-1).tolist() == [num_physical] * num_layers
    per_rank = rank_loads(weight, physical_to_logical, num_ranks)
    assert per_rank.shape == (num_layers, num_ranks)  # P / num_ranks slots each, by the layout
    assert torch.allclose(per_rank.sum(-1), weight.double().sum(-1))  # every token is served somewhere
    if num_groups % num_nodes == 0:  # hierarchical: each routing group's replicas on one node
        group_of_slot = physical_to_logical // (num_logical // num_groups)
        node_of_slot = torch.arange(num_physical) // (num_physical // num_nodes)
        for layer, group in itertools.product(range(num_layers), range(num_groups)):
            assert len(set(node_of_slot[group_of_slot[layer] == group].tolist())) == 1


@st.composite
def placement_problems(draw):
    num_nodes = draw(st.integers(1, 3))
    num_ranks = num_nodes * draw(st.integers(1, 3))
    num_groups = draw(st.integers(1, 4))
    num_logical = num_groups * draw(st.integers(1, 4))
    num_physical = num_ranks * (-(-num_logical // num_ranks) + draw(st.integers(0, 2)))
    num_layers = draw(st.integers(1, 3))
    loads = st.lists(st.integers(0, 10_000) | st.sampled_from([0, 1]), min_size=num_logical, max_size=num_logical)
    weight = torch.tensor(draw(st.lists(loads, min_size=num_layers, max_size=num_layers)))
    if draw(st.booleans()):
        weight = weight.float() / 7
    return weight, num_physical, num_groups, num_nodes, num_ranks


@settings(max_examples=300, deadline=None)
@given(placement_problems())
def test_placement_invariants(problem):
    weight, num_physical, num_groups, num_nodes, num_ranks = problem
    physical_to_logical, counts = rebalance_experts(*problem)
    check_placement(weight, physical_to_logical, counts, num_physical, num_groups, num_nodes, num_ranks)
    again = rebalance_experts(weight.clone(), num_physical, num_groups, num_nodes, num_ranks)
    assert torch.equal(again[0], physical_to_logical) and torch.equal(again[1], counts)  # deterministic
    published, published_counts = rebalance_experts(*problem, refine=False)
    check_placement(weight, published, published_counts, num_physical, num_groups, num_nodes, num_ranks)
    assert bool((peak(weight, physical_to_logical, num_ranks) <= peak(weight, published, num_ranks) * (1 + 1e-9)
                 ).all())  # the refinement never makes the heaviest rank heavier
    if num_groups % num_nodes:  # the global policy
        assert torch.equal(rebalance_experts(weight, num_physical, 1, 1, num_ranks)[0], physical_to_logical)


def test_a_group_stays_on_one_node_where_the_global_policy_would_split_it():
    # 8 experts in 4 groups of 2, 2 nodes of 2 ranks, 12 slots. Balancing alone (the global policy) spreads the hot
    # experts 0 and 1 (one group) over both nodes; the hierarchical policy keeps every group on one node.
    weight = torch.tensor([[400, 300, 60, 50, 40, 30, 20, 10]])
    group_of_slot = torch.arange(12) // 6  # node of each slot

    def nodes_of(physical_to_logical, group):
        return set(group_of_slot[physical_to_logical[0] // 2 == group].tolist())

    split, _ = rebalance_experts(weight, 12, 1, 1, 4)
    assert nodes_of(split, 0) == {0, 1}
    kept, counts = rebalance_experts(weight, 12, 4, 2, 4)
    check_placement(weight, kept, counts, 12, 4, 2, 4)
    assert all(len(nodes_of(kept, group)) == 1 for group in range(4))
    assert float(rank_balance(weight, kept, 4)[0]) < float(rank_balance(weight, split, 4)[0])  # what it costs


def test_spare_slots_of_a_layer_without_load_are_spread():
    physical_to_logical, counts = rebalance_experts(torch.zeros(2, 4), 8, 1, 1, 2)
    assert counts.tolist() == [[2, 2, 2, 2]] * 2
    assert rank_balance(torch.zeros(2, 4), physical_to_logical, 2).tolist() == [1.0, 1.0]


def test_placement_time_at_deepseek_v3_scale():
    # 58 MoE layers, 256 experts in 8 groups, 288 slots on 32 ranks of 4 nodes; printed with -s (no time assert).
    weight = torch.stack([zipf_load(256, 1.0, seed) for seed in range(58)])
    for refine in (False, True):
        start = time.perf_counter()
        physical_to_logical, counts = rebalance_experts(weight, 288, 8, 4, 32, refine=refine)
        elapsed = time.perf_counter() - start
        check_placement(weight, physical_to_logical, counts, 288, 8, 4, 32)
        balance = rank_balance(weight, physical_to_logical, 32)
        print(f"\nplacement L=58 E=256 P=288 ranks=32 nodes=4 groups=8, Zipf 1.0, refine={refine}: "
              f"{elapsed * 1e3:.1f} ms, balance mean {float(balance.mean()):.3f} min {float(balance.min()):.3f}")


def test_rank_balance_examples():
    assert rank_balance(torch.ones(1, 4), trivial_placement(1, 4, 4), 2).tolist() == [1.0]
    # expert 0 has two replicas of 4.5 tokens: rank 0 serves 4.5 + 3, rank 1 4.5 + 0
    weight, physical_to_logical = torch.tensor([[9, 3, 0]]), torch.tensor([[0, 1, 0, 2]])
    assert rank_loads(weight, physical_to_logical, 2).tolist() == [[7.5, 4.5]]
    assert rank_balance(weight, physical_to_logical, 2).tolist() == [6.0 / 7.5]
    assert rank_balance(torch.zeros(1, 3), physical_to_logical, 2).tolist() == [1.0]
    assert replica_count(physical_to_logical, 3).tolist() == [[2, 1, 1]]


def test_trivial_placement():
    assert trivial_placement(2, 3, 5).tolist() == [[0, 1, 2, 0, 1]] * 2
    assert trivial_placement(0, 3, 3).shape == (0, 3)
    physical_to_logical, counts = rebalance_experts(torch.zeros(0, 4), 4, 1, 1, 2)  # a model without MoE layers
    assert physical_to_logical.shape == (0, 4) and counts.shape == (0, 4)
    assert rank_balance(torch.zeros(0, 4), physical_to_logical, 2).shape == (0,)


def kept(old: torch.Tensor, new: torch.Tensor) -> int:
    return int((old == new).sum())


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.data())
def test_keep_slots_stable(num_ranks, per_rank, num_layers, num_logical, data):
    ids = st.lists(st.integers(0, num_logical - 1), min_size=num_ranks * per_rank, max_size=num_ranks * per_rank)
    old = torch.tensor(data.draw(st.lists(ids, min_size=num_layers, max_size=num_layers)))
    new = torch.tensor(data.draw(st.lists(ids, min_size=num_layers, max_size=num_layers)))
    stable = keep_slots_stable(old, new, num_ranks)
    assert stable.dtype == torch.int64 and torch.equal(stable, keep_slots_stable(old, new, num_ranks))
    by_rank = (num_layers, num_ranks, per_rank)
    assert torch.equal(stable.view(by_rank).sort(-1).values, new.view(by_rank).sort(-1).values)  # same multisets
    assert kept(old, stable) >= kept(old, new)
    best = sum(min(o.count(e), n.count(e)) for o_layer, n_layer in zip(old.view(by_rank).tolist(),
                                                                       new.view(by_rank).tolist(), strict=True)
               for o, n in zip(o_layer, n_layer, strict=True) for e in set(n))
    assert kept(old, stable) == best  # the most slots any reordering within ranks keeps
    assert torch.equal(keep_slots_stable(new, new, num_ranks), new)


def test_keep_slots_stable_example():
    old = torch.tensor([[0, 1, 2, 3]])
    new = torch.tensor([[1, 4, 3, 2]])  # rank 0 holds {1, 4}, rank 1 {3, 2}
    assert keep_slots_stable(old, new, 2).tolist() == [[4, 1, 2, 3]]


@pytest.mark.parametrize(("call", "name"), [
    (lambda: rebalance_experts(torch.ones(2, 4), 3, 1, 1, 1), "num_physical"),
    (lambda: rebalance_experts(torch.ones(2, 4), 6, 1, 1, 4), "num_physical"),
    (lambda: rebalance_experts(torch.ones(2, 4), 8, 3, 1, 2), "num_groups"),
    (lambda: rebalance_experts(torch.ones(2, 4), 8, 2, 3, 2), "num_nodes"),
    (lambda: rebalance_experts(torch.ones(2, 4), 8, 1, 1, 0), "num_ranks"),
    (lambda: rebalance_experts(torch.ones(2, 4), 8, 1, 1, True), "num_ranks"),
    (lambda: rebalance_experts(torch.ones(4), 8, 1, 1, 2), "weight"),
    (lambda: rebalance_experts(-torch.ones(2, 4), 8, 1, 1, 2), "weight"),
    (lambda: rebalance_experts(torch.tensor([[1.0, float("nan")]]), 2, 1, 1, 2), "weight"),
    (lambda: rebalance_experts([[1, 2]], 2, 1, 1, 2), "weight"),
    (lambda: rank_balance(torch.ones(1, 3), torch.tensor([[0, 1, 1, 0]]), 2), "physical_to_logical"),
    (lambda: rank_balance(torch.ones(1, 3), torch.tensor([[0, 1, 2, 3]]), 2), "physical_to_logical"),
    (lambda: rank_balance(torch.ones(1, 3), torch.tensor([[0.0, 1.0, 2.0, 0.0]]), 2), "physical_to_logical"),
    (lambda: rank_balance(torch.ones(2, 3), torch.tensor([[0, 1, 2, 0]]), 2), "physical_to_logical"),
    (lambda: rank_balance(torch.ones(1, 3), torch.tensor([[0, 1, 2, 0]]), 3), "num_ranks"),
    (lambda: keep_slots_stable(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 6, dtype=torch.int64), 2), "old"),
    (lambda: keep_slots_stable(torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64), 3),
     "num_ranks"),
    (lambda: keep_slots_stable(torch.zeros(1, 4, dtype=torch.int64), -torch.ones(1, 4, dtype=torch.int64), 2), "new"),
    (lambda: trivial_placement(1, 4, 3), "num_physical"),
    (lambda: trivial_placement(-1, 4, 4), "num_layers"),
    (lambda: trivial_placement(1, 0, 4), "num_logical"),
])
def test_bad_arguments_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()
