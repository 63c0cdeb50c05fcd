"""The step records: invariants of SamplingInputs / ModelWorkerBatch / StepOutput / ForwardBatch, the one
declaration of ForwardBatch's per-token and per-row fields, and the graph buffers and views built from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raymoe.runner.forward_batch import ForwardBatch, SamplingBatchInfo
from raymoe.runner.graph_buffers import DUMMY_SLOT, PADDING, GraphInputBuffers, Pad
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.step_output import StepOutput, TokenLogprobs
from raymoe.step.worker_batch import ModelWorkerBatch


def _decode(rows: list[int], seq_lens: list[int]) -> ModelWorkerBatch:
    n = len(rows)
    return ModelWorkerBatch(ForwardMode.DECODE, [10 + r for r in rows], rows, seq_lens, [s - 1 for s in seq_lens],
                            [1] * n, [100 + r for r in rows], sampling=SamplingInputs.greedy(n))


def test_sampling_inputs_rows_must_agree():
    s = SamplingInputs.greedy(3)
    assert s.batch_size == 3 and s.all_greedy
    with pytest.raises(ValueError, match="SamplingInputs.seeds"):
        dataclasses.replace(s, seeds=[None, 1])
    assert not dataclasses.replace(s, temperatures=[0.0, 0.7, 0.0]).all_greedy
    assert dataclasses.replace(s, temperatures=[0.0, 0.7, 0.0], top_ks=[-1, 1, 5]).all_greedy


def test_worker_batch_carries_one_sampling_row_per_request():
    b = _decode([0, 1], [5, 6])
    with pytest.raises(ValueError, match="ModelWorkerBatch.sampling has 1 rows, expected 2"):
        dataclasses.replace(b, sampling=SamplingInputs.greedy(1))
    assert ModelWorkerBatch.idle().sampling is None


def test_step_decisions_copy_equals_a_validated_replace_and_checks_the_capacity():
    b = _decode([0, 1, 2], [5, 6, 7])
    decided = b.with_step_decisions((3, 0), True, 4, 8)
    assert decided == dataclasses.replace(b, global_num_tokens=(3, 0), use_tbo=True, graph_bs=4, dispatch_capacity=8)
    assert (b.use_tbo, b.graph_bs, b.dispatch_capacity) == (False, None, None)  # the original is unchanged
    for cap in (0, 2):
        with pytest.raises(ValueError, match=f"dispatch_capacity {cap} must be >= 1 and hold its 3 tokens"):
            b.with_step_decisions((3,), False, None, cap)
    idle = ModelWorkerBatch.idle().with_step_decisions((0, 3), True, None, 1)
    assert idle == dataclasses.replace(ModelWorkerBatch.idle(), global_num_tokens=(0, 3), use_tbo=True,
                                       dispatch_capacity=1)


def test_step_output_logprobs_are_none_or_one_per_token():
    lp = TokenLogprobs(-0.5, [3], [-0.5])
    assert StepOutput([1, 2], [lp, None]).logprobs[0] is lp
    assert StepOutput([1, 2]).logprobs == []
    with pytest.raises(ValueError, match="StepOutput.logprobs"):
        StepOutput([1, 2], [lp])


def test_sampling_batch_info_tensorizes_the_record():
    s = dataclasses.replace(SamplingInputs.greedy(2), temperatures=[0.0, 0.5], top_ks=[-1, 7], seeds=[None, 9])
    info = SamplingBatchInfo.from_inputs(s, "cpu")
    assert info.temperatures.dtype == torch.float32 and info.top_ks.dtype == torch.int64
    assert info.top_ks.tolist() == [-1, 7] and info.seeds == [None, 9] and not info.all_greedy


def test_every_tensor_and_host_list_field_is_declared_once():
    """Adding a per-token/per-row field to ForwardBatch without declaring it must fail here (graph buffers and
    TBO children would silently miss it)."""
    by_type = {f.name: f.type for f in dataclasses.fields(ForwardBatch)}
    tensors = {n for n, t in by_type.items() if t == "torch.Tensor"}
    host_lists = {n for n in by_type if n.endswith("_cpu")}
    declared = ForwardBatch.TOKEN_TENSORS + ForwardBatch.ROW_TENSORS
    assert set(declared) == tensors and len(declared) == len(tensors)
    assert set(ForwardBatch.OPTIONAL_TOKEN_TENSORS) == {n for n, t in by_type.items() if t == "torch.Tensor | None"}
    assert set(ForwardBatch.ROW_LISTS + ForwardBatch.OPTIONAL_ROW_LISTS) == host_lists
    assert set(PADDING) == tensors


def test_forward_batch_checks_shapes():
    fb = ForwardBatch.from_worker_batch(_decode([0, 1, 2], [4, 5, 6]), "cpu")
    with pytest.raises(ValueError, match="ForwardBatch.positions"):
        dataclasses.replace(fb, positions=fb.positions[:2])
    with pytest.raises(ValueError, match="ForwardBatch.seq_lens_cpu"):
        dataclasses.replace(fb, seq_lens_cpu=[4, 5])


def test_narrow_gives_views_and_sliced_lists():
    mb = ModelWorkerBatch(ForwardMode.EXTEND, list(range(10, 17)), [3, 4, 5], [2, 3, 2], [0, 0, 0], [2, 3, 2],
                          list(range(1, 8)), sampling=SamplingInputs.greedy(3))
    fb = ForwardBatch.from_worker_batch(mb, "cpu")
    child = fb.narrow((2, 5), (1, 2), sample_indices=torch.tensor([2]), sampling=None)
    assert child.batch_size == 1 and child.num_tokens == 3 and child.sampling is None
    assert child.input_ids.tolist() == [12, 13, 14] and child.req_pool_indices_cpu == [4]
    for name in ForwardBatch.TOKEN_TENSORS + ("req_pool_indices", "seq_lens"):
        assert getattr(child, name).untyped_storage().data_ptr() == getattr(fb, name).untyped_storage().data_ptr()
    assert child.sample_indices.tolist() == [2]


def test_graph_buffers_copy_every_declared_field_and_pad_by_the_table():
    bufs = GraphInputBuffers.create(8, "cpu", seq_len_fill_value=1)
    fb = ForwardBatch.from_worker_batch(_decode([3, 5, 6], [7, 8, 9]), "cpu")
    padded_lens = bufs.populate(fb, 4)
    assert padded_lens == [7, 8, 9, 1]
    static = bufs.forward_batch(4, attn_backend=None, use_tbo=False)
    for name in ForwardBatch.TOKEN_TENSORS + ForwardBatch.ROW_TENSORS:
        got = getattr(static, name).tolist()
        pad = PADDING[name]
        if pad is Pad.CONSTANT:
            assert got == [0, 1, 2, 3], name
            continue
        assert got[:3] == getattr(fb, name).tolist(), name
        assert got[3] == (1 if pad is Pad.SEQ_LEN_FILL else pad), name
    assert static.out_cache_loc[3].item() == DUMMY_SLOT
    assert static.padding_mask.tolist() == [False, False, False, True]  # the MoE layers give row 3 no expert
    assert static.narrow((2, 4), (2, 4)).padding_mask.tolist() == [False, True]
    bufs.populate(ForwardBatch.from_worker_batch(_decode([3], [7]), "cpu"), 2)
    assert bufs.forward_batch(2, attn_backend=None, use_tbo=False).padding_mask.tolist() == [False, True]
    assert fb.padding_mask is None  # an eager batch: every row is real
