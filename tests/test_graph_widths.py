"""KV-width ladder of the decode graphs: the ladder and width selection (pure functions), the RunnerConfig
option, and the fixed-width capture path (what CUDA runs) forced on CPU: greedy decoding through the graphs gives
the eager tokens while the sequences cross width boundaries, each replay's attention kernels see a [bs, w]
index tensor of the width picked for the step, and more than one width is replayed.

Exactness: float64, as ``tests/test_graph_runner.py`` (a stale or wrong-width buffer is an O(1) logit error).
"""

from __future__ import annotations

import pytest
import torch

from raymoe.attention.torch_native import TorchNativeAttnBackend
from raymoe.config import GraphConfig, OverlapConfig
from raymoe.runner.graph_buckets import kv_width_ladder, select_graph_bs, select_kv_width
from raymoe.runner.model_runner import ModelRunner, RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

CTX = 40  # ReqToTokenPool row width, tokens
WIDTHS = (8, 16, 32)  # forced ladder on CPU; the runner adds CTX
PROMPTS = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31 + i for i in range(10)]]  # lengths 3, 6, 10
STEPS = CTX - 10  # the longest request ends at seq_len CTX: widths 16, 32 and 40 are all crossed


def test_kv_width_ladder():
    assert kv_width_ladder(2048) == [128, 256, 512, 1024, 2048]
    assert kv_width_ladder(512, 64) == [64, 128, 256, 512]
    assert kv_width_ladder(300) == [128, 256, 300]          # the row width always ends the ladder
    assert kv_width_ladder(256, 256) == [256]               # first width == row width: one width
    assert kv_width_ladder(257, 256) == [256, 257]
    assert kv_width_ladder(48) == [48]                      # tiny row width below the first width
    assert kv_width_ladder(2) == [2]
    assert kv_width_ladder(2048, None) == [2048]            # ladder disabled
    assert kv_width_ladder(5, 1) == [1, 2, 4, 5]
    for bad in ((0, 128), (16, 0), (16, -4)):
        with pytest.raises(ValueError):
            kv_width_ladder(*bad)


def test_select_kv_width():
    widths = [128, 256, 300]
    assert [select_kv_width(n, widths) for n in (1, 127, 128, 129, 256, 257, 300)] == [128, 128, 128, 256, 256,
                                                                                      300, 300]
    assert select_kv_width(301, widths) is None             # above the largest: no graph holds it
    assert select_kv_width(0, widths) == 128
    assert select_kv_width(2, [2]) == 2
    assert select_kv_width(1, []) is None


def test_runner_config_kv_widths():
    cfg = RunnerConfig("m", "float32", 8, 4, 2048)
    assert cfg.graph_kv_widths == (128, 256, 512, 1024, 2048)
    widths = {w: RunnerConfig("m", "float32", 8, 4, 2048, graph=GraphConfig(cuda_graph_min_kv_width=w)).graph_kv_widths
              for w in (512, None)}
    assert widths == {512: (512, 1024, 2048), None: (2048,)}
    assert RunnerConfig("m", "float32", 8, 4, 64).graph_kv_widths == (64,)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="cuda_graph_min_kv_width"):
            RunnerConfig("m", "float32", 8, 4, 2048, graph=GraphConfig(cuda_graph_min_kv_width=bad))


def test_engine_option_reaches_the_rank(tiny_model):
    from raymoe.actors.factory import runner_config_for
    from raymoe.config.device_defaults import with_device
    from raymoe.engine import _split_options
    from raymoe.errors import InvalidRequestError

    for value in (64, None):
        cfg = runner_config_for(with_device(_split_options(tiny_model, {"cuda_graph_min_kv_width": value}), "cpu"))
        assert cfg.graph.cuda_graph_min_kv_width == value
    with pytest.raises(InvalidRequestError) as e:
        _split_options(tiny_model, {"cuda_graph_min_kv_width": 0})
    assert e.value.field == "cuda_graph_min_kv_width"


def _runner(path: str, tbo: bool) -> ModelRunner:
    rows = 2 * len(PROMPTS)
    cfg = RunnerConfig(path, "float64", num_kv_slots=rows * CTX, max_req_rows=rows, max_context_len=CTX,
                       graph=GraphConfig(cuda_graph_max_bs=4), overlap=OverlapConfig(enable_tbo=tbo))
    return ModelRunner(cfg)


def _slot(row: int, pos: int) -> int:
    return 1 + row * CTX + pos


def _prefill(rows: list[int]) -> ModelWorkerBatch:
    ids = [t for p in PROMPTS for t in p]
    lens = [len(p) for p in PROMPTS]
    loc = [_slot(r, i) for r, n in zip(rows, lens, strict=True) for i in range(n)]
    return ModelWorkerBatch(ForwardMode.EXTEND, ids, rows, lens, [0] * len(rows), lens, loc,
                            sampling=SamplingInputs.greedy(len(rows)))


def _decode(rows: list[int], tokens: list[int], step: int, graph_bs: int | None, use_tbo: bool) -> ModelWorkerBatch:
    lens = [len(p) + step + 1 for p in PROMPTS]
    return ModelWorkerBatch(ForwardMode.DECODE, tokens, rows, lens, [n - 1 for n in lens], [1] * len(rows),
                            [_slot(r, n - 1) for r, n in zip(rows, lens, strict=True)],
                            sampling=SamplingInputs.greedy(len(rows)), graph_bs=graph_bs, use_tbo=use_tbo)


def _greedy(runner: ModelRunner, rows: list[int], graph: bool, tbo: bool) -> list[list[int]]:
    """Greedy tokens of PROMPTS in table rows ``rows``: prefill, then STEPS decode steps (through the graphs of
    bucket 4, with 1 padding row, or eagerly)."""
    out = runner.forward_batch_generation(_prefill(rows)).next_token_ids
    seqs = [[t] for t in out]
    graph_bs = select_graph_bs(len(rows), runner.cfg.graph_capture_sizes) if graph else None
    for step in range(STEPS):
        batch = _decode(rows, [s[-1] for s in seqs], step, graph_bs, tbo and graph)
        assert not graph or runner.graph_runner.can_run(batch)
        for s, t in zip(seqs, runner.forward_batch_generation(batch).next_token_ids, strict=True):
            s.append(t)
    return seqs


def _record_decode_widths(monkeypatch) -> list[tuple[int, int]]:
    """Record the [rows, width] of ``kv_indices`` every torch_native decode kernel call reads."""
    seen: list[tuple[int, int]] = []
    decode = TorchNativeAttnBackend.forward_decode

    def recording(self, q, k, v, layer_id, forward_batch):
        seen.append(tuple(self.kv_indices.shape))
        return decode(self, q, k, v, layer_id, forward_batch)

    monkeypatch.setattr(TorchNativeAttnBackend, "forward_decode", recording)
    return seen


def test_cpu_default_is_one_dynamic_capture_per_bucket(tiny_model):
    gr = _runner(tiny_model, tbo=False).graph_runner
    assert not gr.fixed_width and gr.kv_widths == [CTX]
    assert sorted(gr.graphs) == [(bs, False, CTX) for bs in (1, 2, 4)]


@pytest.mark.parametrize("tbo", [False, True], ids=["plain", "tbo"])
def test_fixed_widths_match_eager_across_width_boundaries(tiny_model, monkeypatch, tbo):
    runner = _runner(tiny_model, tbo)
    gr = runner.graph_runner = runner.build_graph_runner(kv_widths=WIDTHS)
    assert gr.fixed_width and gr.kv_widths == [*WIDTHS, CTX]
    splits = (False, True) if tbo else (False,)
    assert sorted(gr.graphs) == sorted((bs, t, w) for bs in (1, 2, 4) for t in splits if bs >= 2 or not t
                                       for w in (*WIDTHS, CTX))
    with pytest.raises(ValueError, match="KV widths"):
        runner.build_graph_runner(kv_widths=(8, CTX + 1))

    eager_rows, graph_rows = [0, 1, 2], [3, 4, 5]
    eager = _greedy(runner, eager_rows, graph=False, tbo=tbo)
    seen = _record_decode_widths(monkeypatch)
    graph = _greedy(runner, graph_rows, graph=True, tbo=tbo)
    assert graph == eager

    # Each replay's decode kernels read [rows, w] with w the smallest width holding the step's longest sequence.
    layers = runner.model_config.num_hidden_layers
    expected = []
    for step in range(STEPS):
        w = select_kv_width(max(len(p) for p in PROMPTS) + step + 1, gr.kv_widths)
        expected += ([(2, w), (2, w)] if tbo else [(4, w)]) * layers  # bucket 4, TBO halves of 2 rows
    assert sorted(seen) == sorted(expected)
    assert gr.replayed_widths == {8: 0, 16: 6, 32: 16, CTX: 8}  # seq_len 11..16, 17..32, 33..40


@pytest.mark.parametrize("widths,finite", [((16, 32), True), ((CTX,), False)], ids=["width16", "full"])
def test_graph_reads_only_its_kv_width(tiny_model, widths, finite):
    """Table columns 16.. of every row point at a slot of NaN keys/values (masked, but NaN poisons SDPA anyway):
    a step of seq_len 11 replays the 16-wide graph, which must not read them; the full-width control does."""
    runner = _runner(tiny_model, tbo=False)
    gr = runner.graph_runner = runner.build_graph_runner(kv_widths=widths)
    rows = [0, 1, 2]
    runner.forward_batch_generation(_prefill(rows))
    poison = runner.cfg.num_kv_slots  # last slot, beyond every _slot() used here
    for buf in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer:
        buf[poison] = float("nan")
    runner.req_to_token_pool.req_to_token[:, 16:] = poison
    step = _decode(rows, [5, 6, 7], 0, 4, False)
    eager = runner.forward(runner.prepare(step)).clone()
    graph = gr.replay(runner.prepare(step, for_graph=True))
    assert gr.replayed_widths[widths[0]] == 1
    assert torch.isfinite(eager).all()
    assert bool(torch.isfinite(graph).all()) == finite
    if finite:
        assert (graph - eager).abs().max().item() <= 1e-5
