"""Prefix-aware routing across DP groups (``raymoe.actors.dp_router``, ``raymoe.kvcache.prefix_events``).

Checked: the driver's index of a group's radix tree, fed only by the tree's block-hash deltas, answers exactly the
whole blocks the tree holds after any sequence of inserts, matches, locks, evictions and resets (and when the log is
attached to a tree that already holds prefixes); the bounded-load rule never lets a group's load pass its bound
and otherwise picks the longest cached prefix; and in both drivers (groups in the driver's process, groups behind
pickling links as in their own processes) a conversation's next turn goes to the group that cached its earlier
turns, where load-only routing sends it elsewhere, and the hit shows in the group's radix counter and the routing
counters.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_supervision import EOS, VOCAB, FakeExecutor, detokenize

from raymoe.actors.dp_router import DpRouter, choose_group
from raymoe.actors.driver import Driver
from raymoe.actors.hosted_driver import HostedDriver
from raymoe.actors.loopback_groups import LoopbackGroups
from raymoe.actors.output_batch import OutputBatch
from raymoe.config import CacheConfig, EngineConfig, SchedulerConfig
from raymoe.errors import InvalidRequestError
from raymoe.kvcache.allocator import TokenSlotAllocator
from raymoe.kvcache.prefix_events import PrefixEventLog, block_hashes
from raymoe.kvcache.radix_cache import RadixCache
from raymoe.scheduler.sampling_params import SamplingParams

BLOCK = 4


def _cache_tokens(tree: RadixCache, alloc: TokenSlotAllocator, ids: list[int]) -> None:
    """Cache ``ids`` as a finishing request does (the protocol of ``RadixCache``'s docstring)."""
    m = tree.match_prefix(ids)
    tree.inc_lock_ref(m.last_node)
    own = alloc.alloc(len(ids) - len(m.slots))
    if own is None:
        tree.dec_lock_ref(m.last_node)
        return
    slots = m.slots + own
    n = tree.insert(ids, slots)
    alloc.free(slots[len(m.slots):n])
    tree.dec_lock_ref(m.last_node)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), attach_after=st.integers(0, 10))
def test_the_index_holds_exactly_the_whole_blocks_the_tree_holds(seed, attach_after):
    rng = random.Random(seed)
    alloc = TokenSlotAllocator(160)
    tree = RadixCache(alloc)
    router = DpRouter(2, block_tokens=BLOCK)
    log = PrefixEventLog(BLOCK)
    stems = [[rng.randrange(1, 4) for _ in range(rng.randrange(0, 9))] for _ in range(4)]
    seen: list[list[int]] = []
    locks = []
    for step in range(40):
        if step == attach_after:
            tree.record_events(log)
        op = rng.random()
        if op < 0.5:
            ids = rng.choice(stems) + [rng.randrange(1, 4) for _ in range(rng.randrange(1, 14))]
            _cache_tokens(tree, alloc, ids)
            seen.append(ids)
        elif op < 0.65 and seen:
            m = tree.match_prefix(rng.choice(seen))
            tree.inc_lock_ref(m.last_node)
            locks.append(m.last_node)
        elif op < 0.75 and locks:
            tree.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        elif op < 0.95:
            tree.evict(rng.randrange(1, 20))
        elif not locks:
            tree.reset()
        if step >= attach_after:
            router.apply(0, log.drain())
            for q in seen[-6:] + [s + [1, 2, 3] for s in stems]:
                assert router.cached_tokens(q)[0] == tree.peek_prefix_len(q) // BLOCK * BLOCK, (step, q)
                assert router.cached_tokens(q)[1] == 0
    tree._check_invariants()


def test_block_hashes_are_chained_prefixes():
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 8]
    assert len(block_hashes(a, 4)) == 2 and block_hashes(a[:7], 4) == block_hashes(a, 4)[:1]
    assert block_hashes(a, 4)[1] != block_hashes(b, 4)[1]  # the same second block after a different first one
    assert block_hashes(tuple(a), 4) == block_hashes(a, 4)
    assert block_hashes(a, 4, num_blocks=1) == block_hashes(a, 4)[:1]


@settings(max_examples=200, deadline=None)
@given(cached=st.lists(st.integers(0, 64), min_size=1, max_size=6).flatmap(
    lambda c: st.tuples(st.just(c), st.lists(st.integers(0, 40), min_size=len(c), max_size=len(c)))),
    ratio=st.floats(1.0, 3.0))
def test_the_chosen_group_stays_within_the_bound_and_has_the_longest_prefix_there(cached, ratio):
    cached, loads = cached
    d = choose_group(cached, loads, ratio)
    cap = max(math.ceil(ratio * (sum(loads) + 1) / len(loads)), min(loads) + 1)
    assert loads[d.group] + 1 <= cap
    allowed = [g for g in range(len(loads)) if loads[g] + 1 <= cap]
    assert cached[d.group] == max(cached[g] for g in allowed) == d.expected_cached_tokens
    assert d.best_cached_tokens == max(cached)
    assert d.reason == ("prefix" if cached[d.group] else "load")


@pytest.mark.parametrize("ratio", [1.0, 1.25, 2.0])
def test_a_popular_prefix_never_piles_work_onto_one_group(ratio):
    """Every request shares a prefix only group 0 holds: group 0 takes them up to the bound, then the others do."""
    loads = [0, 0, 0, 0]
    for _ in range(400):
        g = choose_group([64, 0, 0, 0], loads, ratio).group
        loads[g] += 1
        assert max(loads) <= math.ceil(ratio * sum(loads) / len(loads))
    assert loads[0] == max(loads) and (ratio == 1.0 or loads[0] > loads[1])


def test_the_options_are_checked():
    with pytest.raises(InvalidRequestError, match="prefix_routing_max_load_ratio"):
        SchedulerConfig(prefix_routing_max_load_ratio=0.5)
    with pytest.raises(InvalidRequestError, match="load_balance_method"):
        SchedulerConfig(load_balance_method="random")
    with pytest.raises(ValueError, match="dp_size"):
        DpRouter(0)


def _config(method: str) -> EngineConfig:
    return EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=1024, max_context_len=256),
                        scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=None,
                                                  load_balance_method=method))


def _in_process(method: str):
    driver = Driver(_config(method), FakeExecutor(), [EOS], detokenize, dp_size=2, vocab_size=VOCAB)
    driver.record_outputs = True
    rows = OutputBatch()

    def run():
        while driver.has_unfinished():
            driver.step()
            for g in driver.groups:
                rows.extend(g.take_outputs())
    return driver, rows, run


def _hosted(method: str):
    rows = OutputBatch()
    groups = LoopbackGroups(_config(method), [EOS], detokenize, VOCAB, lambda d: FakeExecutor(), rows.extend, 2)
    driver = HostedDriver(_config(method), groups, 2, vocab_size=VOCAB)

    def run():
        for _ in range(500):
            if not driver.has_unfinished():
                return
            driver.step()
        raise AssertionError("no progress")
    return driver, rows, run


@pytest.mark.parametrize("make", [_in_process, _hosted], ids=["in_process", "hosted"])
@pytest.mark.parametrize("method", ["prefix_aware", "shortest_queue"])
def test_a_conversations_next_turn_goes_to_the_group_that_cached_it(make, method):
    driver, rows, run = make(method)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    system = [7] * 32
    turn1 = {c: system + [10 + c] * 20 for c in range(2)}
    for c, prompt in turn1.items():
        driver.submit(f"c{c}-t1", prompt, greedy)
    first_group = dict(driver.group_of)
    assert sorted(first_group.values()) == [0, 1]  # by load: one conversation per group
    run()
    out = {}
    for d in rows:
        out.setdefault(d.request_id, []).extend(d.token_ids)
    # Conversation 1's next turn: its prompt, its answer and a new message.
    turn2 = turn1[1] + out["c1-t1"] + [40] * 9
    hits_before = [s.hit_tokens for s in driver.group_stats()]
    driver.submit("c1-t2", turn2, greedy)
    group = driver.group_of["c1-t2"]
    run()
    hits = [s.hit_tokens - b for s, b in zip(driver.group_stats(), hits_before, strict=True)]
    counters = driver.router.counters
    if method == "prefix_aware":
        assert group == first_group["c1-t1"]
        cached = (len(turn1[1]) + len(out["c1-t1"]) - 1) // 16 * 16  # the last token has no KV yet
        assert counters.by_prefix == 1 and counters.expected_cached_tokens == cached
        assert hits[group] >= cached
    else:
        assert group == 0 != first_group["c1-t1"]  # tie by load: the lowest index, which never saw it
        assert counters.by_prefix == 0 and hits[group] == len(system)  # only the shared system prompt
