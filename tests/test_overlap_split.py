"""Property tests of the two-batch-overlap splits, child batches, output merge and the driver's decision."""

from __future__ import annotations

import bisect
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.comm.a2a_plan import child_dispatch_capacity
from raymoe.config import OverlapConfig
from raymoe.overlap.decision import apply_tbo_decision, decide_tbo
from raymoe.overlap.forward import merge_states, split_state
from raymoe.overlap.operations import ForwardState
from raymoe.overlap.split import (
    TboForwardBatchPreparer,
    TboSplit,
    balanced_split_index,
    child_lens,
    compute_split,
    split_is_usable,
    two_chunk_split,
)
from raymoe.runner.forward_batch import ForwardBatch
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

# Fractions a float holds exactly make the share bounds of split_extend meet a boundary (left == threshold * total).
thresholds = st.one_of(st.sampled_from([0.0, 0.125, 0.25, 0.375, 0.5]), st.floats(min_value=0.0, max_value=0.5))
extend_lens_st = st.lists(st.integers(1, 60), min_size=1, max_size=12)


def worker_batch(mode: ForwardMode, extend_lens: list[int], prefix_lens: list[int] | None = None) -> ModelWorkerBatch:
    """A consistent batch: request i has ``prefix_lens[i]`` cached tokens and ``extend_lens[i]`` new ones."""
    if mode == ForwardMode.IDLE:
        return ModelWorkerBatch.idle()
    bs = len(extend_lens)
    prefix_lens = prefix_lens or [0] * bs
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    n = sum(extend_lens)
    prefix_slots = list(range(1000, 1000 + sum(prefix_lens))) if mode == ForwardMode.EXTEND else []
    return ModelWorkerBatch(mode, list(range(7, 7 + n)), list(range(bs)), seq_lens, prefix_lens, list(extend_lens),
                            list(range(1, n + 1)), prefix_slots, SamplingInputs.greedy(bs))


def brute_force_balanced_index(lens: list[int]) -> int:
    """The balanced boundary by trying every one: least ``|left - right|``, the first of equals; 0 without one."""
    gaps = {i: abs(sum(lens[:i]) - sum(lens[i:])) for i in range(1, len(lens))}
    return min(gaps, key=lambda i: (gaps[i], i), default=0)


def positions_of(prefix_lens: list[int], seq_lens: list[int]) -> list[int]:
    return [p for pre, sl in zip(prefix_lens, seq_lens, strict=True) for p in range(pre, sl)]


@settings(max_examples=300, deadline=None)
@given(extend_lens_st, thresholds)
def test_extend_split_covers_parent_in_order(lens, threshold):
    split = compute_split(ForwardMode.EXTEND, lens, threshold)
    total = sum(lens)
    assert split_is_usable(split, total) == (total >= 2)
    a, b = child_lens(split, [0] * len(lens), lens, lens)
    # Children cover the parent's tokens exactly, in order.
    assert sum(a.extend_lens) == split.token_index and sum(b.extend_lens) == total - split.token_index
    assert a.seq_start == 0 and b.seq_end == len(lens)
    assert b.seq_start == (a.seq_end - 1 if split.cut else a.seq_end)
    if split_is_usable(split, total):
        assert a.extend_lens and b.extend_lens and min(a.extend_lens + b.extend_lens) >= 1
    best = brute_force_balanced_index(lens)
    left = sum(lens[:best])
    if len(lens) > 1 and threshold * total <= left <= (1 - threshold) * total:
        assert not split.cut and split.seq_index == best and split.token_index == left
    else:  # two-chunk: token counts differ by at most one
        assert abs(split.token_index - (total - split.token_index)) <= 1
    if split.cut:
        assert 0 < split.left_part < lens[split.seq_index]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 64))
def test_decode_split_is_the_midpoint(bs):
    split = compute_split(ForwardMode.DECODE, [1] * bs, 0.48)
    assert split.seq_index == split.token_index == bs // 2 and not split.cut
    assert split_is_usable(split, bs) == (bs >= 2 or bs == 0)


def _prepare(mb: ModelWorkerBatch, threshold: float) -> ForwardBatch:
    fb = ForwardBatch.from_worker_batch(mb, "cpu")
    TboForwardBatchPreparer.prepare(fb, threshold, ["backend-a", "backend-b"])
    return fb


@settings(max_examples=200, deadline=None)
@given(st.data(), thresholds)
def test_children_fields_match_direct_recomputation(data, threshold):
    lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=8).filter(lambda x: sum(x) >= 2))
    prefix = data.draw(st.lists(st.integers(0, 30), min_size=len(lens), max_size=len(lens)))
    mb = worker_batch(ForwardMode.EXTEND, lens, prefix)
    fb = _prepare(mb, threshold)
    a, b = fb.tbo_children
    assert a.tbo_parent_token_range == (0, a.num_tokens) and b.tbo_parent_token_range == (a.num_tokens, fb.num_tokens)
    assert a.attn_backend == "backend-a" and b.attn_backend == "backend-b"
    for child in (a, b):
        t0, t1 = child.tbo_parent_token_range
        assert child.num_tokens > 0 and child.batch_size == len(child.seq_lens_cpu)
        # Recompute the child as if the driver had sent it on its own: same positions, lengths, slots, ids.
        direct = ForwardBatch.from_worker_batch(worker_batch(ForwardMode.EXTEND, child.extend_lens_cpu,
                                                             child.prefix_lens_cpu), "cpu")
        assert child.positions.tolist() == direct.positions.tolist()
        assert child.positions.tolist() == positions_of(child.prefix_lens_cpu, child.seq_lens_cpu)
        assert child.seq_lens.tolist() == child.seq_lens_cpu == direct.seq_lens_cpu
        assert child.sample_indices.tolist() == direct.sample_indices.tolist()
        assert child.input_ids.tolist() == fb.input_ids[t0:t1].tolist()
        assert child.out_cache_loc.tolist() == fb.out_cache_loc[t0:t1].tolist()
    split = compute_split(ForwardMode.EXTEND, lens, threshold)
    if split.cut:  # child B's first sequence continues where child A's last one stops
        assert b.prefix_lens_cpu[0] == a.seq_lens_cpu[-1] == prefix[split.seq_index] + split.left_part
        assert b.seq_lens_cpu[0] == fb.seq_lens_cpu[split.seq_index]
        assert b.req_pool_indices_cpu[0] == a.req_pool_indices_cpu[-1]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_merge_restores_token_order(data):
    mode = data.draw(st.sampled_from([ForwardMode.EXTEND, ForwardMode.DECODE]))
    lens = data.draw(extend_lens_st if mode == ForwardMode.EXTEND else st.integers(2, 20).map(lambda n: [1] * n))
    if sum(lens) < 2:
        return
    fb = _prepare(worker_batch(mode, lens), 0.48)
    hidden = torch.arange(fb.num_tokens, dtype=torch.float32)[:, None].repeat(1, 3)
    parent = ForwardState(hidden_states=hidden.clone(), residual=None, forward_batch=fb)
    children = split_state(parent)
    for c in children:  # a layer that changes rows in place per child must not reorder them
        c.hidden_states = c.hidden_states * 2
    merged = merge_states(parent, children).hidden_states
    assert torch.equal(merged, hidden * 2)
    assert torch.equal(merged[fb.sample_indices, 0], 2 * fb.sample_indices.float())


def test_idle_split_gives_two_empty_children():
    fb = _prepare(ModelWorkerBatch.idle(), 0.48)
    assert [c.num_tokens for c in fb.tbo_children] == [0, 0]
    assert [c.batch_size for c in fb.tbo_children] == [0, 0]


batch_specs = st.one_of(
    st.just((ForwardMode.IDLE, [])),
    st.integers(1, 40).map(lambda n: (ForwardMode.DECODE, [1] * n)),
    extend_lens_st.map(lambda x: (ForwardMode.EXTEND, x)),
    st.integers(1, 6).map(lambda n: (ForwardMode.MIXED, [1] * n)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(batch_specs, min_size=1, max_size=4), st.integers(1, 40), st.integers(1, 80), thresholds)
def test_decide_tbo_properties(specs, min_decode, min_extend, threshold):
    batches = [worker_batch(m, lens) for m, lens in specs]
    cfg = OverlapConfig(enable_tbo=True, tbo_min_tokens_decode=min_decode, tbo_min_tokens_extend=min_extend,
                        tbo_token_distribution_threshold=threshold)
    use = decide_tbo(batches, cfg)
    assert not decide_tbo(batches, OverlapConfig(enable_tbo=False))
    out = apply_tbo_decision(batches, cfg)
    assert [b.use_tbo for b in out] == [use] * len(batches)  # every rank gets the same answer
    active = [b for b in batches if b.forward_mode != ForwardMode.IDLE]
    if not active or any(b.forward_mode == ForwardMode.MIXED for b in batches):
        assert not use
    if use:
        modes = {b.forward_mode for b in active}
        assert len(modes) == 1
        mode = modes.pop()
        assert mode != ForwardMode.EXTEND or len(active) == len(batches)
        needed = min_decode if mode == ForwardMode.DECODE else min_extend
        assert max(b.num_tokens for b in active) >= needed
        for b in active:  # never an empty child on a rank that has tokens
            fb = _prepare(b, threshold)
            assert all(c.num_tokens > 0 for c in fb.tbo_children)


def test_decide_tbo_examples():
    cfg = OverlapConfig(enable_tbo=True, tbo_min_tokens_decode=4, tbo_min_tokens_extend=8)
    dec = worker_batch(ForwardMode.DECODE, [1] * 6)
    ext = worker_batch(ForwardMode.EXTEND, [5, 9])
    idle = ModelWorkerBatch.idle()
    assert decide_tbo([dec, idle], cfg)
    assert decide_tbo([dec, worker_batch(ForwardMode.DECODE, [1] * 2)], cfg)
    assert not decide_tbo([dec, worker_batch(ForwardMode.DECODE, [1])], cfg)  # bs 1: a child would be empty
    assert not decide_tbo([worker_batch(ForwardMode.DECODE, [1] * 3)], cfg)  # below the decode minimum
    assert decide_tbo([ext, worker_batch(ForwardMode.EXTEND, [3])], cfg)
    assert not decide_tbo([ext, idle], cfg)  # EXTEND next to IDLE: schedules would differ
    assert not decide_tbo([ext, dec], cfg)
    assert not decide_tbo([idle, idle], cfg)
    assert not decide_tbo([dec, worker_batch(ForwardMode.MIXED, [1] * 6)], cfg)


def reference_extend_split(lens: list[int], threshold: float) -> TboSplit:
    """The EXTEND split from its definition: the brute-force balanced boundary when its left share is within
    ``[threshold, 1 - threshold]``, else a cut at token ``T // 2`` located by bisecting the sequence starts."""
    total = sum(lens)
    best = brute_force_balanced_index(lens)
    left = sum(lens[:best])
    if best > 0 and threshold * total <= left <= (1 - threshold) * total:
        return TboSplit(best, left)
    token = total // 2
    starts = [sum(lens[:i]) for i in range(len(lens))]
    if token in starts:
        return TboSplit(starts.index(token), token)
    i = bisect.bisect_right(starts, token) - 1
    return TboSplit(i, token, cut=True, left_part=token - starts[i])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=9), thresholds)
def test_extend_split_equals_the_reference(lens, threshold):
    assert balanced_split_index(lens) == brute_force_balanced_index(lens)
    assert compute_split(ForwardMode.EXTEND, lens, threshold) == reference_extend_split(lens, threshold)


def test_split_boundaries():
    # ties go to the first boundary; the worst boundary is never chosen
    assert balanced_split_index([2, 2, 2, 2]) == 2 and balanced_split_index([1, 1, 1]) == 1
    assert balanced_split_index([5, 1, 1, 1, 1, 1]) == 1 and balanced_split_index([1, 1, 1, 1, 1, 5]) == 5
    assert balanced_split_index([7]) == 0 and balanced_split_index([]) == 0
    # a left share exactly at either bound keeps the balanced split
    assert compute_split(ForwardMode.EXTEND, [1, 3], 0.25) == TboSplit(1, 1)
    assert compute_split(ForwardMode.EXTEND, [3, 1], 0.25) == TboSplit(1, 3)
    assert compute_split(ForwardMode.EXTEND, [1, 3], 0.375) == TboSplit(1, 2, cut=True, left_part=1)
    # two-chunk: token T // 2 starts a sequence (no cut), lies inside one (cut), or there is nothing to cut
    assert two_chunk_split([2, 2, 9, 1]) == TboSplit(2, 7, cut=True, left_part=3)
    assert two_chunk_split([3, 1, 4]) == TboSplit(2, 4)
    assert two_chunk_split([]) == TboSplit(0, 0)
    assert compute_split(ForwardMode.IDLE, [], 0.4) == TboSplit(0, 0)
    with pytest.raises(ValueError, match="cannot split a MIXED batch"):
        compute_split(ForwardMode.MIXED, [1, 1], 0.4)
    assert split_is_usable(TboSplit(1, 1), 3) and split_is_usable(TboSplit(0, 0), 0)
    assert not split_is_usable(TboSplit(0, 0), 3) and not split_is_usable(TboSplit(3, 3), 3)


@pytest.mark.parametrize(("mode", "lens", "capacity"), [(ForwardMode.EXTEND, [10, 3], 16),
                                                        (ForwardMode.DECODE, [1] * 5, 8)])
def test_children_are_plain_batches_of_the_parents_device_and_dtype(mode, lens, capacity):
    """Children never inherit the step-wide flags (TBO, graph bucket, sampling, children of their own), carry the
    child capacity, and build their tensors on the parent's device with its dtype, not torch's defaults."""
    mb = dataclasses.replace(worker_batch(mode, lens, [2] * len(lens)), use_tbo=True, graph_bs=8,
                             dispatch_capacity=capacity)
    fb = ForwardBatch.from_worker_batch(mb, "cpu")
    fb = dataclasses.replace(fb, seq_lens=fb.seq_lens.to(torch.int32))
    TboForwardBatchPreparer.prepare(fb, 0.48, ["a", "b"])
    with torch.device("meta"):  # a default device other than the parent's (a CUDA rank's parent vs torch's CPU)
        TboForwardBatchPreparer.prepare(fb, 0.48, ["a", "b"])  # preparing again replaces the children
    assert mode != ForwardMode.EXTEND or compute_split(mode, lens, 0.48).cut  # the cut path builds new seq_lens
    for child in fb.tbo_children:
        assert child.use_tbo is False and child.graph_bs is None and child.tbo_children is None
        assert child.sampling is None
        assert child.dispatch_capacity == child_dispatch_capacity(capacity, mode)
        for t in (child.seq_lens, child.sample_indices, child.positions):
            assert t.device == fb.seq_lens.device
        assert child.seq_lens.dtype == torch.int32 and child.sample_indices.dtype == torch.int64


def test_prepare_refuses_unsplittable_batches_and_a_missing_backend():
    with pytest.raises(ValueError, match="cannot be split"):
        _prepare(worker_batch(ForwardMode.EXTEND, [1]), 0.48)
    fb = ForwardBatch.from_worker_batch(worker_batch(ForwardMode.EXTEND, [4, 4]), "cpu")
    with pytest.raises(ValueError):
        TboForwardBatchPreparer.prepare(fb, 0.48, ["only-one"])


def reference_decide_tbo(batches: list[ModelWorkerBatch], cfg: OverlapConfig) -> bool:
    """The decision from the rules in ``raymoe.overlap.decision``'s docstring, with "both children get tokens"
    stated directly: a group splits when it has at least two tokens (DECODE: two sequences)."""
    active = [b for b in batches if b.forward_mode != ForwardMode.IDLE]
    modes = {b.forward_mode for b in active}
    if not cfg.enable_tbo or len(modes) != 1:
        return False
    (mode,) = modes
    if mode == ForwardMode.DECODE:
        need = cfg.tbo_min_tokens_decode
    elif mode == ForwardMode.EXTEND and len(active) == len(batches):
        need = cfg.tbo_min_tokens_extend
    else:
        return False
    return max(b.num_tokens for b in active) >= need and all(b.num_tokens >= 2 for b in active)


@settings(max_examples=500, deadline=None)
@given(st.lists(batch_specs, min_size=1, max_size=4), st.integers(1, 12), st.integers(1, 24), thresholds,
       st.booleans())
def test_decide_tbo_equals_the_rules_both_ways(specs, min_decode, min_extend, threshold, enable):
    """Small batches and minimums, so the busiest group often has exactly the minimum: TBO runs exactly when
    the rules say so (not only "TBO implies the rules")."""
    specs = [(m, lens[:12]) for m, lens in specs]
    batches = [worker_batch(m, lens) for m, lens in specs]
    cfg = OverlapConfig(enable_tbo=enable, tbo_min_tokens_decode=min_decode, tbo_min_tokens_extend=min_extend,
                        tbo_token_distribution_threshold=threshold)
    assert decide_tbo(batches, cfg) == reference_decide_tbo(batches, cfg)


def test_decide_tbo_at_the_minimum_and_unchanged_batches_pass_through():
    cfg = OverlapConfig(enable_tbo=True, tbo_min_tokens_decode=4, tbo_min_tokens_extend=8)
    assert decide_tbo([worker_batch(ForwardMode.DECODE, [1] * 4)], cfg)  # exactly the minimum runs TBO
    assert not decide_tbo([worker_batch(ForwardMode.DECODE, [1] * 3)], cfg)
    assert decide_tbo([worker_batch(ForwardMode.EXTEND, [4, 4])], cfg)
    assert not decide_tbo([worker_batch(ForwardMode.EXTEND, [4, 3])], cfg)
    batches = [worker_batch(ForwardMode.DECODE, [1] * 6), ModelWorkerBatch.idle(use_tbo=True)]
    out = apply_tbo_decision(batches, cfg)
    assert out[1] is batches[1]  # already carries the answer: no copy
    assert out[0] is not batches[0] and out[0].use_tbo and not batches[0].use_tbo
