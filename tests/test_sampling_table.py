"""SamplingTable (``raymoe.step.sampling_table``): a rank keeps each request's sampling numbers from the step that
admitted it, so later steps carry none; a row reused by another request reads that request's numbers; a row never
sent is an error naming it. The scheduler-side half (every batch's rows resolve to their requests' numbers and
positions) is checked by ``tests/test_scheduler.py``'s ``FakeRank`` over random workloads."""

from __future__ import annotations

import pickle

import pytest

from raymoe.scheduler.req import Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs, SamplingRow
from raymoe.step.sampling_table import SamplingTable
from raymoe.step.worker_batch import ModelWorkerBatch


def _decode(rows: list[int], seq_lens: list[int], sent: tuple = ()) -> ModelWorkerBatch:
    bs = len(rows)
    return ModelWorkerBatch(ForwardMode.DECODE, [1] * bs, rows, seq_lens, [n - 1 for n in seq_lens], [1] * bs,
                            list(range(1, bs + 1)), sampling_rows=sent)


def test_numbers_sent_once_are_read_by_every_later_step():
    table = SamplingTable()
    first = _decode([4, 9], [6, 3], sent=((0, SamplingRow(0.7, 0.9, 5, 0.1, 11, 2, 5)),
                                          (1, SamplingRow(0.0, 1.0, -1, 0.0, None, None, 3))))
    rec = table.resolve(first)
    assert (rec.temperatures, rec.top_ps, rec.top_ks, rec.min_ps) == ([0.7, 0.0], [0.9, 1.0], [5, -1], [0.1, 0.0])
    assert (rec.seeds, rec.logprobs, rec.output_lens) == ([11, None], [2, None], [1, 0])
    later = table.resolve(_decode([9, 4], [5, 8]))  # another order, two steps on
    assert later.temperatures == [0.0, 0.7] and later.seeds == [None, 11] and later.output_lens == [2, 3]


def test_a_row_reused_by_another_request_reads_the_new_numbers():
    table = SamplingTable()
    table.resolve(_decode([2], [4], sent=((0, SamplingRow(0.5, 1.0, -1, 0.0, 3, None, 2)),)))
    table.resolve(_decode([2], [5]))
    rec = table.resolve(_decode([2], [8], sent=((0, SamplingRow(1.0, 0.8, 4, 0.0, None, 1, 8)),)))
    assert rec.temperatures == [1.0] and rec.seeds == [None] and rec.logprobs == [1] and rec.output_lens == [0]


def test_a_row_never_sent_is_an_error_naming_it():
    table = SamplingTable()
    table.resolve(_decode([1], [3], sent=((0, SamplingRow(0.0, 1.0, -1, 0.0, None, None, 2)),)))
    with pytest.raises(ValueError, match="^ReqToTokenPool row 7 has no sampling numbers on this rank"):
        table.resolve(_decode([1, 7], [4, 5]))


def test_a_batch_with_its_own_record_and_an_idle_batch():
    table = SamplingTable()
    assert table.resolve(ModelWorkerBatch.idle()) is None
    own = SamplingInputs.greedy(2)
    assert table.resolve(ModelWorkerBatch(ForwardMode.DECODE, [1, 1], [0, 1], [2, 2], [1, 1], [1, 1], [1, 2],
                                          sampling=own)) is own


def test_sampling_rows_outside_the_batch_are_refused():
    with pytest.raises(ValueError, match="sampling_rows names a row outside"):
        _decode([0], [2], sent=((1, SamplingRow(0.0, 1.0, -1, 0.0, None, None, 1)),))


def test_a_steady_decode_batch_carries_no_sampling_numbers_and_is_smaller():
    """Built by the scheduler: the first step of each request carries its row; a decode step of the same
    requests carries none, so its pickled size no longer grows with the sampling record."""
    reqs = [Req(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.5, seed=i, logprobs=1, max_tokens=8))
            for i in range(32)]
    for i, r in enumerate(reqs):
        r.req_pool_idx, r.kv_slots = i, [1 + 4 * i + k for k in range(3)]
    first = ScheduleBatch.build(reqs, ForwardMode.EXTEND, [3] * 32)
    assert [i for i, _ in first.worker_batch.sampling_rows] == list(range(32))
    first.mark_scheduled()
    for i, r in enumerate(reqs):
        r.kv_slots.append(1 + 4 * i + 3)
    decode = ScheduleBatch.build(reqs, ForwardMode.DECODE, [1] * 32).worker_batch
    assert decode.sampling is None and decode.sampling_rows == ()
    with_record = ModelWorkerBatch(**{**decode.__dict__, "sampling": SamplingTable().resolve(first.worker_batch)})
    assert len(pickle.dumps(decode)) < 0.6 * len(pickle.dumps(with_record))
