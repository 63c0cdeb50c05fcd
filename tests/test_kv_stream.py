"""Layer-by-layer KV writes of PD prefill ranks (``raymoe.kvcache.kv_stream``, ``raymoe.step.kv_stream``) with two
real NIXL agents in this process: a layer's rows land when every half of the step has passed its mark (and not the
later layers'), a page written by two steps (a chunk boundary inside a page) ends with the later rows, the last
chunk's notification is what the receiver waits for, and a request whose write failed in an earlier step is
reported as failed at its last chunk (the receiver stops waiting at once). The scheduler's side: every step that
computes prompt positions carries them, a radix hit's cached prefix goes with the first step, a re-admitted
request streams again from its start."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from raymoe.scheduler.req import Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.kv_stream import KVStreamChunk, KVStreamTarget

pytest.importorskip("nixl_cu12", reason="needs NIXL (pip install nixl-cu12)")

PAGE, SLOTS, LAYERS = 4, 63, 2  # 64 rows: 16 pages of 4


def _layout(fill: float):
    from raymoe.kvcache.kv_layout import KVLayout

    bufs = tuple(torch.full((SLOTS + 1, 2, 8), fill) for _ in range(2 * LAYERS))  # key, value per layer
    return KVLayout(bufs, PAGE, 2)


@pytest.fixture
def agents():
    from raymoe.kvcache.kv_stream import KVStreamer
    from raymoe.kvcache.nixl_transfer import NixlKVTransfer

    tag = f"{time.monotonic_ns()}"
    src, dst = _layout(0.0), _layout(-1.0)
    for k, b in enumerate(src.buffers):  # row s of buffer k holds 1000 k + s
        b.copy_((1000 * k + torch.arange(SLOTS + 1, dtype=torch.float32))[:, None, None].expand_as(b))
    p, d = NixlKVTransfer(f"p{tag}", src), NixlKVTransfer(f"d{tag}", dst)
    names = [p.add_peer(d.metadata()), d.add_peer(p.metadata())]
    t = threading.Thread(target=p.connect, args=([names[0]],))
    t.start()
    d.connect([names[1]])
    t.join()
    streamer = KVStreamer(p, src)
    yield SimpleNamespace(p=p, d=d, src=src, dst=dst, streamer=streamer, d_name=names[0], p_name=names[1])
    streamer.close()
    p.close()
    d.close()


def _rows(layout, layer: int, slots: list[int]) -> torch.Tensor:
    idx = torch.tensor(slots)
    return torch.stack([layout.buffers[2 * layer + j][idx] for j in range(2)])


def _wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_rows_move_layer_by_layer_and_a_split_page_ends_with_the_later_step(agents):
    a = agents
    a.d.expect("r1", 30)
    assert a.d._poller is not None  # the decode agent progresses UCX while it expects the rows
    # positions 0..5 in source slots 8..13 (pages 2, 3), destination slots 20..25 (pages 5, 6)
    first = KVStreamChunk("r1", (a.d_name,), tuple(range(8, 14)), tuple(range(20, 26)), last=False)
    stream = a.streamer.begin([first], tp_rank=0)
    stream.children = 2  # a two-batch-overlap step: both halves must pass a layer
    half_a, half_b = object(), object()
    stream.layer_done(0, half_a)
    time.sleep(0.2)
    assert torch.all(_rows(a.dst, 0, list(range(20, 26))) == -1)  # half B has not stored layer 0 yet
    stream.layer_done(0, half_b)
    _wait_until(lambda: torch.equal(_rows(a.dst, 0, list(range(20, 26))), _rows(a.src, 0, list(range(8, 14)))))
    assert torch.all(_rows(a.dst, 1, list(range(20, 26))) == -1)  # layer 1 not posted before its mark
    stream.finish()  # posts layer 1, waits for both
    assert torch.equal(_rows(a.dst, 1, list(range(20, 26))), _rows(a.src, 1, list(range(8, 14))))

    # positions 6..9: source 14, 15 (page 3 again, computed by this step: their rows change), 16, 17 (page 4);
    # page 3 moves whole again and keeps positions 4, 5
    a.src.buffers[0][14:16] += 0.5
    second = KVStreamChunk("r1", (a.d_name,), tuple(range(14, 18)), tuple(range(26, 30)), last=True)
    stream = a.streamer.begin([second], tp_rank=0)
    stream.finish()  # no marks at all: every layer goes after the forward
    a.d.receive(a.p_name, [], "r1", 10)
    _wait_until(lambda: a.d._poller is None)  # the expected request came: the poller ended
    for layer in range(LAYERS):
        assert torch.equal(_rows(a.dst, layer, list(range(20, 30))), _rows(a.src, layer, list(range(8, 18))))
    assert a.streamer.failures == 0 and a.streamer.writes == 2 * LAYERS


def test_a_failed_write_makes_the_last_chunk_a_failure_notification(agents, monkeypatch):
    from raymoe.kvcache.kv_transfer import KVTransferError

    a = agents
    a.d.expect("r2", 30)
    real = a.p.post_write
    calls = []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise KVTransferError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(a.p, "post_write", flaky)
    for chunk in (KVStreamChunk("r2", (a.d_name,), (4, 5, 6, 7), (8, 9, 10, 11), last=False),
                  KVStreamChunk("r2", (a.d_name,), (12, 13), (16, 17), last=True)):
        a.streamer.begin([chunk], tp_rank=0).finish()
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="could not write"):
        a.d.receive(a.p_name, [], "r2", 20)
    assert time.monotonic() - t0 < 5 and a.streamer.failures == 1


def test_chunks_that_do_not_match_page_for_page_are_refused(agents):
    bad = KVStreamChunk("r3", (agents.d_name,), (3, 4), (8, 9), last=True)  # pages 0, 1 -> page 2 only
    with pytest.raises(ValueError, match="touch 2 pages"):
        agents.streamer.begin([bad], tp_rank=0)
    with pytest.raises(ValueError, match="none for TP rank 1"):
        agents.streamer.begin([KVStreamChunk("r3", (agents.d_name,), (8,), (8,), last=True)], tp_rank=1)


def test_the_scheduler_streams_every_prompt_position_once_per_admission():
    target = KVStreamTarget("s", ("d0",), tuple(range(100, 110)), 5.0)
    req = Req("s", list(range(1, 11)), SamplingParams(max_tokens=1), export_kv=True, kv_stream=target)
    req.req_pool_idx, req.prefix_len = 0, 3
    req.kv_slots = list(range(40, 47))  # a radix hit of 3 positions, then a first chunk of 4
    first = ScheduleBatch.build([req], ForwardMode.EXTEND, [4])
    (chunk,) = first.worker_batch.kv_streams
    assert chunk.src_slots == tuple(range(40, 47)) and chunk.dst_slots == tuple(range(100, 107))
    assert not chunk.last
    first.mark_scheduled()
    req.kv_slots += [47, 48, 49]
    second = ScheduleBatch.build([req], ForwardMode.EXTEND, [3])
    (chunk,) = second.worker_batch.kv_streams
    assert chunk.src_slots == (47, 48, 49) and chunk.dst_slots == (107, 108, 109) and chunk.last
    second.mark_scheduled()
    req.table_len = 0  # re-admitted (after a retraction): the prompt streams again from its start
    again = ScheduleBatch.build([req], ForwardMode.EXTEND, [10])
    assert again.worker_batch.kv_streams[0].dst_slots == tuple(range(100, 110))
    plain = Req("t", [1, 2], SamplingParams(max_tokens=1))
    plain.req_pool_idx, plain.kv_slots = 1, [60, 61]
    assert ScheduleBatch.build([plain], ForwardMode.EXTEND, [2]).worker_batch.kv_streams == ()
