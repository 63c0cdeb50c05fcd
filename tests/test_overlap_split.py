"""Property tests of the two-batch-overlap splits, child batches, output merge and the driver's decision."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raymoe.config import OverlapConfig
from raymoe.overlap.decision import apply_tbo_decision, decide_tbo
from raymoe.overlap.forward import merge_states, split_state
from raymoe.overlap.operations import ForwardState
from raymoe.overlap.split import (
    TboForwardBatchPreparer,
    balanced_split_index,
    child_lens,
    compute_split,
    split_is_usable,
)
from raymoe.runner.forward_batch import ForwardBatch
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

thresholds = st.floats(min_value=0.0, max_value=0.5)
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
    left_share = sum(lens[:balanced_split_index(lens)]) / total
    if len(lens) > 1 and threshold <= left_share <= 1 - threshold:
        assert not split.cut and split.seq_index == balanced_split_index(lens)
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
