"""Paged KV allocation (raymoe.kvcache.paged_allocator): the allocator alone, then the scheduler driving it with a
fake rank that also checks the page layout a block-table kernel relies on."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import FakeRank, drive, reference, stagger, workload

from raymoe.config import CacheConfig, SchedulerConfig
from raymoe.kvcache.paged_allocator import PagedTokenSlotAllocator, pool_slots
from raymoe.kvcache.radix_cache import RadixCache
from raymoe.scheduler.req import FinishKind, Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.scheduler import Scheduler


def test_requests_continue_in_their_last_page_then_take_fresh_pages():
    a = PagedTokenSlotAllocator(num_pages=4, page_size=4)
    assert a.size == 16 and a.available_size() == 16
    first = a.alloc(6)                      # pages 1 and 2 (page 0 is reserved for the dummy slot)
    assert first == [4, 5, 6, 7, 8, 9]
    assert a.available_size() == 8 and a.stranded_size() == 2
    assert a.alloc(3, after=9) == [10, 11, 12]    # the rest of page 2, then page 3
    with pytest.raises(ValueError, match="not the last slot"):
        a.alloc(1, after=8)
    assert a.decode_cost([12, 7]) == 4      # 12 has room in its page; 7 ends page 1
    assert a.alloc_decode([12]) == [13]
    assert a.alloc(9) is None and a.available_size() == 4   # one page left: nothing allocated


def test_a_page_is_free_once_every_slot_handed_out_from_it_is():
    a = PagedTokenSlotAllocator(num_pages=2, page_size=4)
    s = a.alloc(6)
    a.free(s[:3])                            # page 1 still has slot 7
    assert a.available_size() == 0 and a.stranded_size() == 5
    a.free([s[3]])
    assert a.available_size() == 4
    a.free(s[4:])
    assert a.available_size() == 8 and a.stranded_size() == 0
    with pytest.raises(ValueError, match="not currently allocated"):
        a.free([s[0]])


def test_aligned_prefix_len_keeps_whole_in_order_pages():
    a = PagedTokenSlotAllocator(num_pages=8, page_size=4)
    assert a.aligned_prefix_len([4, 5, 6, 7, 12, 13, 14, 15, 20, 21]) == 8
    assert a.aligned_prefix_len([4, 5, 6, 7, 12, 13, 9, 15]) == 4     # mixed page
    assert a.aligned_prefix_len([5, 6, 7, 8]) == 0                    # not page-aligned
    assert pool_slots(100, 16) == 16 * 7 - 1 and pool_slots(100, 1) == 100


def test_cut_match_locks_exactly_the_used_prefix():
    a = PagedTokenSlotAllocator(num_pages=8, page_size=4)
    tree = RadixCache(a)
    ids = list(range(10))
    tree.insert(ids, a.alloc(10))
    m = tree.match_prefix(ids)
    cut = tree.cut_match(m, 4)
    assert cut.slots == m.slots[:4]
    tree.inc_lock_ref(cut.last_node)
    assert tree.protected_size() == 4 and tree.evictable_size() == 6
    tree.dec_lock_ref(cut.last_node)
    assert tree.cut_match(m, 0).last_node is tree.root_node


class PagedFakeRank(FakeRank):
    """The scheduler tests' fake rank, plus the block-table invariant: position ``p`` of every request sits at
    ``page(p // P) * P + p % P`` of one page per aligned run of ``P`` positions."""

    def step(self, b):
        out = super().step(b)
        page = self.sched.token_allocator.page_size
        for row, seq_len in zip(b.req_pool_indices, b.seq_lens, strict=True):
            table = self.table[row]
            for pos in range(seq_len):
                start = table[pos - pos % page]
                assert start % page == 0 and table[pos] == start + pos % page, f"row {row} position {pos}"
        self.pages_checked = True
        return out


def make_paged(page: int, pool: int, radix: bool = True, **sched_kw) -> Scheduler:
    s = Scheduler(SchedulerConfig(**sched_kw), CacheConfig(max_total_tokens=pool, max_context_len=512,
                                                            enable_radix_cache=radix, page_size=page),
                  eos_token_ids=(999,))
    s.rank = PagedFakeRank(s)
    return s


def check(s: Scheduler, specs, finished) -> None:
    ctx = min(512, s.token_allocator.size + 1)
    for rid, prompt, params in specs:
        assert finished[rid].output_ids == reference(prompt, params, ctx=ctx), rid
        assert finished[rid].finished_reason.kind == FinishKind.LENGTH
    assert s.rank.pages_checked


def test_shared_prefixes_are_shared_in_whole_pages():
    specs = workload(n=8, shared=21, seed=3)
    s = make_paged(page=4, pool=600, chunked_prefill_size=7)
    finished = drive(s, stagger(specs, lambda i: 12 * i))  # earlier requests are cached when later ones arrive
    check(s, specs, finished)
    assert [finished[rid].cached_tokens for rid, _, _ in specs] == [0] + [20] * 7  # 21 shared: 5 whole pages


def test_a_cached_path_mixing_two_requests_inside_a_page_is_cut_there():
    # r0 (10 tokens) and r1 (r0's prompt + 10 more) prefill together; r0 finishes first and caches positions
    # [0, 10), r1 then caches [10, 20) from its own pages: the cached path mixes both inside page [8, 12).
    base = list(range(1, 11))
    longer = base + list(range(20, 30))
    specs = [("r0", base, SamplingParams(max_tokens=1)), ("r1", longer, SamplingParams(max_tokens=3)),
             ("r2", longer + [7], SamplingParams(max_tokens=3))]
    s = make_paged(page=4, pool=64)
    finished = drive(s, {0: [Req(*specs[0]), Req(*specs[1])], 10: [Req(*specs[2])]})
    check(s, specs, finished)
    assert finished["r2"].cached_tokens == 8


def test_small_paged_pool_retracts_and_still_matches():
    specs = workload(n=10, shared=4, seed=5, max_tokens=(20, 40))
    s = make_paged(page=4, pool=72, chunked_prefill_size=8)
    check(s, specs, drive(s, {0: [Req(*spec) for spec in specs]}))
    assert s.num_retractions > 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), n=st.integers(1, 8), shared=st.integers(0, 20), page=st.sampled_from([2, 4, 16]),
       pages=st.integers(2, 40), chunk=st.one_of(st.none(), st.integers(1, 16)), radix=st.booleans(),
       spread=st.integers(0, 4), overlap=st.booleans(), mixed=st.booleans())
def test_random_paged_workloads(seed, n, shared, page, pages, chunk, radix, spread, overlap, mixed):
    specs = workload(n=n, shared=shared, seed=seed, max_tokens=(1, 30))
    specs = [spec for spec in specs if len(spec[1]) <= page * pages]  # prompts the pool can hold
    s = make_paged(page=page, pool=page * pages, radix=radix, chunked_prefill_size=chunk, max_prefill_tokens=48,
                   enable_mixed_chunk=mixed)
    finished = drive(s, stagger(specs, lambda i: spread * i), overlap=overlap)
    ctx = min(512, s.token_allocator.size + 1)
    for rid, prompt, params in specs:
        assert finished[rid].output_ids == reference(prompt, params, ctx=ctx), rid



def test_idle_paged_pool_evicts_cached_pages_to_admit_a_request():
    """Found by the random workloads: with nothing running, cached prefixes held 9 tokens whose pages also
    stranded 7 free slots, so a 14-token prompt never fit the admission check (0 available) and the scheduler
    stalled. An idle pool now evicts the whole cache before giving up."""
    specs = [spec for spec in workload(n=8, shared=5, seed=0, max_tokens=(1, 30)) if len(spec[1]) <= 16]
    s = make_paged(page=4, pool=16, radix=True, chunked_prefill_size=None, max_prefill_tokens=48)
    finished = drive(s, stagger(specs, lambda i: 0))
    ctx = min(512, s.token_allocator.size + 1)
    for rid, prompt, params in specs:
        assert finished[rid].output_ids == reference(prompt, params, ctx=ctx), rid
