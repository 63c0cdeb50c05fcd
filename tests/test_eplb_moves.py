"""Expert load balancing below the engine: the placement record, the ranks' routing tables and counters, the
driver's rebalance plan (chunks, sources, commits after their transfers) and the weight mover on two gloo ranks."""

from __future__ import annotations

import pytest
import torch

from raymoe.comm.expert_input import NO_EXPERT
from raymoe.config import ParallelConfig
from raymoe.eplb.controller import COMMIT_AFTER_STEPS, EplbController, ep_node_count
from raymoe.eplb.expert_map import ExpertRouting
from raymoe.eplb.location import ExpertLocation
from raymoe.eplb.weight_mover import ExpertWeightMover
from raymoe.step.expert_update import ExpertTransfer, ExpertUpdate, LayerCommit
from tests.dist_harness import run_ranks

E, P, EP, L = 8, 10, 2, 2


def _skewed_load(num_layers: int = L) -> list[int]:
    """Cumulative counters of one group, flattened [L * E]: experts 0 and 1 (both on rank 0) take most pairs."""
    row = [400, 300, 50, 40, 30, 20, 10, 10]
    return [x * (layer + 1) for layer in range(num_layers) for x in row]


def test_location_checks_and_tables():
    loc = ExpertLocation.trivial(L, E, P)
    assert loc.physical_to_logical[0] == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
    assert loc.max_replicas == 3
    table, counts = loc.routing_table(0)
    assert counts[0] == 2 and table[0] == [0, 8, 0] and table[2] == [2, 2, 2]
    assert ExpertLocation.from_json(loc.to_json()) == loc
    with pytest.raises(ValueError, match="has no slot"):
        ExpertLocation(E, ((0,) * P,))
    with pytest.raises(ValueError, match="outside"):
        ExpertLocation(E, (tuple(range(P)),))


def test_routing_spreads_over_replicas_and_counts():
    loc = ExpertLocation.trivial(1, E, P)
    counter = torch.zeros(E + 1, dtype=torch.int64)
    routing = ExpertRouting.build(*loc.routing_table(0), counter, 0, "cpu")
    ids = torch.tensor([[0, 2]] * 6 + [[NO_EXPERT, NO_EXPERT]], dtype=torch.int64)
    routing.count(ids)
    phys = routing.to_physical(ids)
    assert counter.tolist() == [6, 0, 6, 0, 0, 0, 0, 0, 2]
    assert phys[-1].tolist() == [NO_EXPERT, NO_EXPERT]
    hot = phys[:-1, 0].tolist()
    assert sorted(set(hot)) == [0, 8] and abs(hot.count(0) - hot.count(8)) <= 1  # replicas share expert 0
    assert phys[:-1, 1].tolist() == [2] * 6
    table = routing.table
    new = loc.with_layer(0, (1, 0, 2, 3, 4, 5, 6, 7, 1, 1))
    routing.update(*new.routing_table(0))
    assert routing.table is table and routing.counts.tolist()[1] == 3
    assert set(routing.to_physical(torch.full((9, 1), 1, dtype=torch.int64)).view(-1).tolist()) == {0, 8, 9}


def _controller(k: int = 1, pieces: int = 1) -> EplbController:
    return EplbController(ExpertLocation.trivial(L, E, P), EP, enable_eplb=True, record_interval=1, window_steps=100,
                          rebalance_every=1, min_window_tokens=1, experts_per_step=k, pieces_per_expert=pieces)


def _drain(ctl: EplbController, max_steps: int = 200, record: bool = True) -> list[ExpertUpdate | None]:
    """Updates of consecutive steps from the first rebalance until its moves are all sent."""
    if record:
        ctl.record([_skewed_load()])
    updates = [ctl.next_update()]
    while ctl.moving and len(updates) < max_steps:
        updates.append(ctl.next_update())
    return updates


@pytest.mark.parametrize(("k", "pieces"), [(1, 1), (2, 1), (1, 3)])
def test_rebalance_plan_is_a_valid_schedule(k, pieces):
    ctl = _controller(k, pieces)
    ctl.record([_skewed_load()])
    before = ctl.balance()
    start = ctl.location
    updates = _drain(ctl, record=False)
    assert ctl.num_rebalances == 1 and ctl.location != start
    per_rank = P // EP
    # replay the plan on virtual ranks: slot -> expert held, staged copies per layer
    held = [list(r) for r in start.physical_to_logical]
    staged: dict[int, dict[int, tuple[int, list[int]]]] = {}  # layer -> slot -> (expert, pieces received)
    posted_at: dict[int, int] = {}
    for step, u in enumerate(updates):
        if u is None:
            continue
        if u.commit is not None:
            layer = u.commit.layer
            assert posted_at.get(layer, -1) + COMMIT_AFTER_STEPS <= step, "a layer commits after its transfers had time"
            for slot, e in enumerate(u.commit.physical_to_logical):
                if held[layer][slot] != e:
                    assert staged[layer][slot] == (e, list(range(pieces))), "every piece, in order"
            held[layer] = list(u.commit.physical_to_logical)
            staged.pop(layer, None)
        sends, recvs = [0] * EP, [0] * EP
        for t in u.transfers:
            s, d = t.src_slot // per_rank, t.dst_slot // per_rank
            sends[s] += 1
            recvs[d] += 1
            expert, got = staged.setdefault(t.layer, {}).get(t.dst_slot, (held[t.layer][t.src_slot], []))
            assert expert == held[t.layer][t.src_slot] and t.num_pieces == pieces
            staged[t.layer][t.dst_slot] = (expert, [*got, t.piece])
            posted_at[t.layer] = step
        assert max(sends, default=0) <= k and max(recvs, default=0) <= k
    assert held == [list(r) for r in ctl.location.physical_to_logical]
    after = ctl.balance()
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_report_and_window():
    ctl = _controller()
    ctl.record([_skewed_load(), None])
    ctl.record([[2 * x for x in _skewed_load()], None])  # cumulative: the second delta equals the first
    rep = ctl.report()
    assert rep.window_steps == 2 and rep.expert_load[0][0] == 800 and len(rep.balance) == L
    ctl.ranks_restarted()
    ctl.record([_skewed_load(), None])  # counters restart with the ranks: taken whole, not as a negative delta
    assert int(ctl.window_load()[0][0]) == 1200


class _Experts:
    """Local experts whose every slot tensor is filled with the expert id it holds."""

    def __init__(self, slots: list[int]):
        self.slot_experts = list(slots)
        self.w13 = torch.tensor(slots, dtype=torch.float32).view(-1, 1, 1).repeat(1, 4, 3).contiguous()
        self.w2 = torch.tensor(slots, dtype=torch.float32).view(-1, 1).repeat(1, 5).contiguous()
        self.refreshed = 0

    def slot_tensors(self):
        return [self.w13, self.w2]

    def refresh_prepared(self, slots=None):
        assert slots, "a commit names the slots it rewrote"
        self.refreshed += 1


def _mover_rank(groups, updates):
    import torch.distributed as dist

    loc = ExpertLocation.trivial(L, E, P)
    per_rank = P // EP
    first = groups.ep_rank * per_rank
    experts = [_Experts(list(loc.physical_to_logical[layer][first:first + per_rank])) for layer in range(L)]
    routings = [ExpertRouting.build(*loc.routing_table(layer), None, 0, "cpu") for layer in range(L)]
    group = dist.new_group(ranks=list(range(EP)))
    mover = ExpertWeightMover(experts, routings, loc, groups.ep_rank, EP, group, list(range(EP)))
    for u in updates:
        if u is not None:
            mover.apply(u)
        dist.barrier()  # stands in for the step's own collectives
    mover.wait()
    def values(t):  # each slot's distinct values: one, its expert id, once every byte arrived
        return [sorted(set(t[i].flatten().tolist())) for i in range(t.shape[0])]

    return ([[values(x.w13), values(x.w2), x.slot_experts, x.refreshed] for x in experts],
            [r.table.tolist() for r in routings])


@pytest.mark.parametrize("pieces", [1, 3])
def test_mover_moves_weights_between_two_gloo_ranks(pieces):
    ctl = _controller(pieces=pieces)
    updates = _drain(ctl)
    results = run_ranks(_mover_rank, ParallelConfig(dp_size=EP, ep_size=EP), updates, cpu_comm="gloo")
    per_rank = P // EP
    for rank, (layers, tables) in enumerate(results):
        for layer, (w13, w2, slots, refreshed) in enumerate(layers):
            want = list(ctl.location.physical_to_logical[layer][rank * per_rank:(rank + 1) * per_rank])
            assert slots == want and w13 == [[float(e)] for e in want] and w2 == w13
            assert refreshed <= 1  # once per commit that rewrote a slot of this rank
            assert tables[layer] == ctl.location.routing_table(layer)[0]


def test_mover_refuses_a_commit_without_weights():
    loc = ExpertLocation.trivial(1, E, P)
    experts = [_Experts(list(loc.physical_to_logical[0][:P // EP]))]
    routing = [ExpertRouting.build(*loc.routing_table(0), None, 0, "cpu")]
    mover = ExpertWeightMover(experts, routing, loc, 0, EP, None, [0, 1])
    swapped = (1, 0) + loc.physical_to_logical[0][2:]
    with pytest.raises(RuntimeError, match="received no weights"):
        mover.apply(ExpertUpdate(commit=LayerCommit(0, swapped)))
    mover.apply(ExpertUpdate(transfers=(ExpertTransfer(0, 1, 0), ExpertTransfer(0, 0, 1))))  # local copies
    mover.apply(ExpertUpdate(commit=LayerCommit(0, swapped)))
    assert experts[0].w13[:2, 0, 0].tolist() == [1.0, 0.0] and experts[0].slot_experts[:2] == [1, 0]


def test_ep_node_count():
    assert ep_node_count(["a", "a", "b", "b"]) == 2
    assert ep_node_count(["a", "a", "a", "a"]) == 1
    assert ep_node_count(["a", "b", "a", "b"]) == 1  # not node-ordered: one node for the placement
    assert ep_node_count(["a", "a", "a", "b"]) == 1  # unequal blocks
