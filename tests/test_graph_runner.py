"""Decode graphs (CPU static-buffer replay): replay equals eager for every padded bucket, no stale buffers,
eager fallback above the largest bucket, padding rows write only the dummy KV slot, and the same on ep=2 dp=2
(with an IDLE group replaying a bucket of padding rows).

Exactness is checked in float64 (replay vs eager within 1e-5; measured: 0). In float32 padding changes GEMM
shapes and CPU kernels round per shape, so even eager alone differs by ~2e-5 between a batch of 3 rows and the same
rows inside a batch of 4; float32 runs check identical greedy tokens and logits within that noise (1e-4).
A buffer, padding or metadata bug shows up as an O(1) difference in either dtype.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from raymoe.config import GraphConfig, OverlapConfig, ParallelConfig
from raymoe.runner.graph_buckets import (
    apply_graph_plan,
    capture_sizes,
    default_capture_sizes,
    plan_graph_bs,
    select_graph_bs,
)
from raymoe.runner.model_runner import ModelRunner, RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

CTX = 48  # ReqToTokenPool row width and KV slots reserved per request


def _slot(req: int, pos: int) -> int:
    return 1 + req * CTX + pos


def _prompt_len(req: int) -> int:
    return 3 + (req * 5) % 11


def _prefill(reqs: list[int], salt: int = 0) -> ModelWorkerBatch:
    ids, loc, lens = [], [], []
    for r in reqs:
        n = _prompt_len(r)
        ids += [(7 * r + 3 * i + salt) % 1900 + 10 for i in range(n)]
        loc += [_slot(r, i) for i in range(n)]
        lens.append(n)
    return ModelWorkerBatch(ForwardMode.EXTEND, ids, list(reqs), lens, [0] * len(reqs), lens, loc,
                            sampling=SamplingInputs.greedy(len(reqs)))


def _decode(reqs: list[int], step: int = 0, graph_bs: int | None = None, use_tbo: bool = False) -> ModelWorkerBatch:
    """Decode token ``step`` of each request (position prompt_len + step); re-running it is idempotent."""
    lens = [_prompt_len(r) + step + 1 for r in reqs]
    slots = [_slot(r, n - 1) for r, n in zip(reqs, lens, strict=True)]
    return ModelWorkerBatch(ForwardMode.DECODE, [(11 * r + step) % 1900 + 10 for r in reqs], list(reqs), lens,
                            [n - 1 for n in lens], [1] * len(reqs), slots,
                            sampling=SamplingInputs.greedy(len(reqs)), graph_bs=graph_bs, use_tbo=use_tbo)


TOL = {"float64": 1e-5, "float32": 1e-4}


def _runner(path: str, rows: int, groups=None, dtype: str = "float64", overlap: OverlapConfig | None = None,
            **graph_opts) -> ModelRunner:
    cfg = RunnerConfig(path, dtype, num_kv_slots=rows * CTX, max_req_rows=rows, max_context_len=CTX,
                       graph=GraphConfig(**graph_opts), overlap=overlap or OverlapConfig())
    return ModelRunner(cfg, groups)


def _eager_logits(runner: ModelRunner, batch: ModelWorkerBatch) -> torch.Tensor:
    return runner.forward(runner.prepare(batch)).clone()


def _graph_logits(runner: ModelRunner, batch: ModelWorkerBatch) -> torch.Tensor:
    fb = runner.prepare(batch, for_graph=True)
    assert runner.graph_runner.can_run(fb)
    return runner.graph_runner.replay(fb).clone()


def _assert_same(graph: torch.Tensor, eager: torch.Tensor, tol: float) -> None:
    """Identical greedy tokens and logits within ``tol`` (absolute)."""
    assert graph.shape == eager.shape
    assert torch.equal(graph.argmax(-1), eager.argmax(-1))
    assert (graph - eager).abs().max().item() <= tol


def _count_replays(runner: ModelRunner) -> list[int]:
    calls = [0]
    replay = runner.graph_runner.replay

    def counted(fb):
        calls[0] += 1
        return replay(fb)

    runner.graph_runner.replay = counted
    return calls


def test_capture_sizes():
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert default_capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(64, cuda_graph_max_bs=20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64, cuda_graph_bs=[8, 1, 4, 128]) == [1, 4, 8]
    assert [select_graph_bs(n, [1, 2, 4, 8]) for n in (0, 1, 3, 5, 8, 9)] == [1, 1, 4, 8, 8, None]
    dec = [_decode([0, 1, 2]), ModelWorkerBatch.idle()]
    assert plan_graph_bs(dec, [1, 2, 4, 8]) == 4
    assert plan_graph_bs([_decode([0, 1, 2]), _prefill([3])], [1, 2, 4, 8]) is None
    assert plan_graph_bs([ModelWorkerBatch.idle()] * 2, [1, 2, 4, 8]) is None
    assert plan_graph_bs(dec, []) is None
    assert [b.graph_bs for b in apply_graph_plan(dec, [1, 2, 4, 8])] == [4, 4]
    assert RunnerConfig("m", "float32", 8, 16, 8, graph=GraphConfig(disable_cuda_graph=True)).graph_capture_sizes == ()


@pytest.mark.parametrize("dtype,tbo", [("float64", False), ("float32", False), ("float64", True)])
def test_replay_matches_eager_every_batch_size(tiny_model, dtype, tbo):
    max_bs = 24
    runner = _runner(tiny_model, max_bs, dtype=dtype, overlap=OverlapConfig(enable_tbo=tbo))
    assert runner.cfg.graph_capture_sizes == (1, 2, 4, 8, 16, 24)
    assert sorted(runner.graph_runner.graphs) == sorted([(bs, False, CTX) for bs in runner.cfg.graph_capture_sizes]
                                                        + [(bs, True, CTX) for bs in (2, 4, 8, 16, 24) if tbo])
    for (bs, use_tbo), static in runner.graph_runner.static_batches.items():
        halves = [c.batch_size for c in static.tbo_children] if use_tbo else None
        assert halves == ([bs // 2, bs - bs // 2] if use_tbo else None)  # split of the padded size
    runner.forward(runner.prepare(_prefill(list(range(max_bs)))))
    replays = _count_replays(runner)
    for bs in range(1, max_bs + 1):
        reqs = [(7 * bs + 5 * j) % max_bs for j in range(bs)]  # 5 and 24 are coprime: bs distinct rows
        eager = _eager_logits(runner, _decode(reqs))
        graph_bs = select_graph_bs(bs, runner.cfg.graph_capture_sizes)
        use_tbo = tbo and graph_bs >= 2  # the split of the padded batch gives both halves rows
        graph = _graph_logits(runner, _decode(reqs, graph_bs=graph_bs, use_tbo=use_tbo))
        assert eager.shape == (bs, runner.model_config.vocab_size)
        _assert_same(graph, eager, TOL[dtype])
        out = runner.forward_batch_generation(_decode(reqs, graph_bs=graph_bs, use_tbo=use_tbo))
        assert out.next_token_ids == eager.argmax(-1).tolist()
    assert replays[0] == 2 * max_bs


def test_consecutive_batches_in_one_bucket_see_no_stale_rows(tiny_model):
    runner = _runner(tiny_model, 16)
    runner.forward(runner.prepare(_prefill(list(range(16)))))
    runner.forward(runner.prepare(_decode(list(range(16)), step=0)))
    batches = [list(range(8)), [10, 14, 12, 11, 13], [3], list(range(15, 7, -1)), [9, 2, 6, 4, 0]]
    expected = [_eager_logits(runner, _decode(reqs, step=1)) for reqs in batches]
    for reqs, ref in zip(batches * 2, expected * 2, strict=True):
        graph = _graph_logits(runner, _decode(reqs, step=1, graph_bs=8))
        _assert_same(graph, ref, TOL["float64"])


def test_batch_above_max_falls_back_to_eager(tiny_model):
    runner = _runner(tiny_model, 16, cuda_graph_max_bs=8)
    assert runner.cfg.graph_capture_sizes == (1, 2, 4, 8)
    runner.forward(runner.prepare(_prefill(list(range(16)))))
    replays = _count_replays(runner)
    reqs = list(range(12))
    assert select_graph_bs(12, runner.cfg.graph_capture_sizes) is None
    ref = _eager_logits(runner, _decode(reqs)).argmax(-1).tolist()
    for graph_bs in (None, 16, 8):  # no bucket, an uncaptured bucket, a bucket too small: all eager
        batch = _decode(reqs, graph_bs=graph_bs)
        assert not runner.graph_runner.can_run(runner.prepare(batch, for_graph=True))
        assert runner.forward_batch_generation(batch).next_token_ids == ref
    assert replays[0] == 0
    assert runner.forward_batch_generation(_decode(reqs[:3], graph_bs=4)).next_token_ids == ref[:3]
    assert replays[0] == 1


def _kv_snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    pool = runner.token_to_kv_pool
    return [b.clone() for b in pool.k_buffer + pool.v_buffer]


def _changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    changed: set[int] = set()
    for b, a in zip(before, after, strict=True):
        changed |= set(torch.nonzero((a != b).flatten(1).any(1)).flatten().tolist())
    return changed


def test_padding_rows_write_only_the_dummy_slot(tiny_model):
    runner = _runner(tiny_model, 8)
    runner.forward(runner.prepare(_prefill(list(range(8)))))
    batch = _decode([6, 1, 4], step=2, graph_bs=4)  # 3 real rows + 1 padding row, fresh slots
    pool = runner.token_to_kv_pool
    for buf in pool.k_buffer + pool.v_buffer:
        buf[0].zero_()
    before, table = _kv_snapshot(runner), runner.req_to_token_pool.req_to_token.clone()
    runner.forward_batch_generation(batch)
    real = set(batch.out_cache_loc)
    assert _changed_slots(before, _kv_snapshot(runner)) == real | {0}
    changed_rows = torch.nonzero(runner.req_to_token_pool.req_to_token != table).tolist()
    rows_and_lens = zip(batch.req_pool_indices, batch.seq_lens, strict=True)
    assert sorted(changed_rows) == sorted([r, n - 1] for r, n in rows_and_lens)
    # An IDLE batch given a bucket (another DP group decodes) replays it with padding rows only.
    replays = _count_replays(runner)
    before = _kv_snapshot(runner)
    assert runner.forward_batch_generation(replace(ModelWorkerBatch.idle(), graph_bs=8)).next_token_ids == []
    assert replays[0] == 1
    assert _changed_slots(before, _kv_snapshot(runner)) <= {0}


def _dp_rank_steps(groups, path: str, tbo: bool) -> list[tuple[int, bool, float]]:
    """On each rank of ep=2 dp=2: every decode batch size 1..8 on group 0 (group 1 decodes another size, or is
    IDLE every third step), eagerly and then through the driver-chosen bucket (with ``tbo``: as a TBO step when
    the bucket has 2 rows or more, and also eagerly with TBO when every group can split). Returns, per
    comparison, (batch size, same greedy tokens, max |logit diff|) of this rank's group."""
    max_bs = 8
    runner = _runner(path, max_bs, groups, overlap=OverlapConfig(enable_tbo=tbo))
    sizes = runner.cfg.graph_capture_sizes
    runner.forward(runner.prepare(_prefill(list(range(max_bs)), salt=groups.dp_rank)))
    replays = _count_replays(runner)
    results = []
    for bs in range(1, max_bs + 1):
        other = 0 if bs % 3 == 0 else max_bs + 1 - bs
        plans = [_decode(list(range(n))[::-1]) if n else ModelWorkerBatch.idle() for n in (bs, other)]
        graph_bs = plan_graph_bs(plans, sizes)
        assert graph_bs == select_graph_bs(max(bs, other), sizes)
        mine = plans[groups.dp_rank]
        refs = [runner.forward(runner.prepare(mine))]
        if tbo and all(n != 1 for n in (bs, other)):  # eager TBO needs two non-empty halves on every busy rank
            refs.append(runner.forward(runner.prepare(replace(mine, use_tbo=True))))
        fb = runner.prepare(replace(mine, graph_bs=graph_bs, use_tbo=tbo and graph_bs >= 2), for_graph=True)
        assert runner.graph_runner.can_run(fb)
        graph = runner.graph_runner.replay(fb)
        n = mine.batch_size
        for ref in refs:
            diff = (graph - ref).abs().max().item() if n else 0.0
            results.append((n, torch.equal(graph.argmax(-1), ref.argmax(-1)), diff))
    assert replays[0] == max_bs
    return results


@pytest.mark.parametrize("tbo", [False, True])
def test_replay_matches_eager_ep2_dp2(tiny_model, tbo):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from dist_harness import run_ranks

    per_rank = run_ranks(_dp_rank_steps, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), tiny_model, tbo)
    assert any(n == 0 for steps in per_rank for n, _, _ in steps), "some steps idle a group"
    for rank, steps in enumerate(per_rank):
        for n, same_tokens, diff in steps:
            assert same_tokens and diff <= 1e-5, (rank, n, diff)
