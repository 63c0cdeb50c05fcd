"""Two-batch overlap and single-batch overlap give the plain path's logits and greedy tokens.

Each rank keeps a plain, a TBO and an SBO runner (in float32 and float64) and feeds them the same multi-step
scenario (prefill, chunked prefill continuation, decode with a growing KV cache, skewed extends that take the
two-chunk split, odd batch sizes, IDLE groups). The TBO decision comes from the driver's ``decide_tbo`` over all
groups' batches, as in the engine.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from raymoe.config import GraphConfig, OverlapConfig, ParallelConfig
from raymoe.overlap.decision import decide_tbo
from raymoe.overlap.split import compute_split
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

TBO_CFG = OverlapConfig(enable_tbo=True, tbo_min_tokens_decode=2, tbo_min_tokens_extend=4)
IDLE = ("idle",)

# Per step, one spec per DP group: ("extend", {row: new tokens}), ("decode", rows) or IDLE.
STEPS = [
    (("extend", {0: 6, 1: 5, 2: 11}), ("extend", {0: 4, 1: 11, 2: 12})),  # balanced | two-chunk; g1 row 2 chunked
    (("decode", [0, 1, 2]), ("decode", [0, 1])),                          # odd batch size
    (("decode", [2, 0, 1]), ("decode", [1, 0])),
    (("extend", {3: 2, 4: 3, 5: 40}), ("extend", {2: 25})),               # skewed: two-chunk; g1 after a prefix
    (("decode", [0, 1, 2, 3, 4, 5]), IDLE),                               # one idle group
    (("decode", [5, 4, 3, 2, 1, 0]), ("decode", [0, 1, 2])),
    (IDLE, ("decode", [2, 0, 1])),
    (("decode", [0, 1, 2, 3, 4]), ("decode", [0, 1, 2])),
    (("decode", [0]), ("decode", [0, 1, 2])),                             # bs 1 cannot split: TBO off
]
EXPECTED_TBO = [True] * 8 + [False]


class _Group:
    """Requests of one DP group: per row its token ids and KV slots; token ids are deterministic."""

    def __init__(self, salt: int):
        self.salt = salt
        self.tokens: dict[int, list[int]] = {}
        self.slots: dict[int, list[int]] = {}
        self.next_slot = 1

    def _new(self, row: int, n: int) -> tuple[list[int], list[int]]:
        have = len(self.tokens.setdefault(row, []))
        ids = [(31 * row + 7 * (have + i) + 101 * self.salt) % 1900 + 20 for i in range(n)]
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return ids, slots

    def batch(self, spec) -> ModelWorkerBatch:
        if spec[0] == "idle":
            return ModelWorkerBatch.idle()
        rows = list(spec[1])
        ext = list(spec[1].values()) if spec[0] == "extend" else [1] * len(rows)
        mode = ForwardMode.EXTEND if spec[0] == "extend" else ForwardMode.DECODE
        ids, locs, prefix_slots, prefix_lens = [], [], [], []
        for row, n in zip(rows, ext, strict=True):
            prefix_lens.append(len(self.tokens.get(row, [])))
            if mode == ForwardMode.EXTEND:
                prefix_slots += self.slots.get(row, [])
            new_ids, new_slots = self._new(row, n)
            ids += new_ids
            locs += new_slots
            self.tokens[row] += new_ids
            self.slots.setdefault(row, []).extend(new_slots)
        bs = len(rows)
        return ModelWorkerBatch(mode, ids, rows, [p + e for p, e in zip(prefix_lens, ext, strict=True)], prefix_lens,
                                ext, locs, prefix_slots, SamplingInputs.greedy(bs))


def _runners(path: str, groups, dtype: str):
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig

    def make(overlap: OverlapConfig):
        return ModelRunner(RunnerConfig(path, dtype, num_kv_slots=512, max_req_rows=8, max_context_len=128,
                                        graph=GraphConfig(disable_cuda_graph=True), overlap=overlap), groups)

    return {"plain": make(OverlapConfig()), "tbo": make(TBO_CFG), "sbo": make(OverlapConfig(enable_sbo=True))}


def _scenario(groups, path: str, steps: list[tuple]) -> list[dict]:
    """Run ``steps`` on this rank's group; per step: the decision and, per dtype, max |logit diff| vs plain of the
    TBO and SBO runners and whether their greedy tokens (every row of the step) match."""
    torch.manual_seed(0)
    runners = {dtype: _runners(path, groups, dtype) for dtype in ("float32", "float64")}
    num_groups = len(steps[0])
    sim = [_Group(g) for g in range(num_groups)]
    results = []
    for step in steps:
        batches = [sim[g].batch(step[g]) for g in range(num_groups)]
        use_tbo = decide_tbo(batches, TBO_CFG)
        mine = batches[groups.dp_rank]
        record = {"use_tbo": use_tbo, "mode": mine.forward_mode.name, "tokens": mine.num_tokens}
        for dtype, rs in runners.items():
            out = {}
            for name, runner in rs.items():
                batch = replace(mine, use_tbo=use_tbo and name == "tbo")
                fb = runner.prepare(batch)
                if batch.use_tbo:  # the step really runs two children that split the tokens
                    children = fb.tbo_children
                    assert [c.num_tokens > 0 for c in children] == [mine.num_tokens > 0] * 2
                out[name] = runner.forward(fb, return_all_logits=True)
            for name in ("tbo", "sbo"):
                diff = (out[name] - out["plain"]).abs().max().item() if mine.num_tokens else 0.0
                same = torch.equal(out[name].argmax(-1), out["plain"].argmax(-1))
                record[f"{dtype}/{name}"] = (diff, same)
        results.append(record)
    return results


def _check(results: list[dict], expected_tbo: list[bool]) -> None:
    assert [r["use_tbo"] for r in results] == expected_tbo
    for i, r in enumerate(results):
        for name in ("tbo", "sbo"):
            # float64: max |diff| <= 1e-5 (in practice exactly 0: every row sees the same sums, only the
            # batching differs). float32: MKL picks another GEMM kernel for <= 3 rows, which alone rounds
            # ~1e-5 differently on O(10) outputs, and sub-batches change row counts; so float32 logits (|x| up to
            # ~25) get 1e-4, and greedy tokens must be identical in both dtypes.
            diff64, same64 = r[f"float64/{name}"]
            diff32, same32 = r[f"float32/{name}"]
            assert diff64 <= 1e-5 and same64, (i, r["mode"], name, r)
            assert diff32 <= 1e-4 and same32, (i, r["mode"], name, r)


def test_scenario_splits_take_the_intended_paths():
    sim = [_Group(0), _Group(1)]
    first = [sim[g].batch(STEPS[0][g]) for g in range(2)]
    assert [compute_split(b.forward_mode, b.extend_lens, 0.48).cut for b in first] == [False, True]
    for step in STEPS[1:3]:
        for g in range(2):
            sim[g].batch(step[g])
    skewed = [sim[g].batch(STEPS[3][g]) for g in range(2)]
    for b in skewed:  # both groups' skewed extends cut one sequence across the children
        assert compute_split(b.forward_mode, b.extend_lens, 0.48).cut
    assert skewed[1].prefix_lens == [12]


@pytest.mark.parametrize("dense_layer", [False, True])
def test_tbo_and_sbo_match_plain_single_rank(tiny_model, tmp_path, dense_layer):
    from raymoe.comm.groups import ParallelGroups
    from raymoe.models.checkpoint import make_checkpoint

    path = tiny_model
    if dense_layer:  # layer 1 has a dense MLP: TBO runs both children through it inside one stage
        path = str(make_checkpoint("qwen3_moe", tmp_path / "dense1", seed=1, num_layers=3, mlp_only_layers=(1,)))
    steps = [(s[0],) for s in STEPS if s[0] != IDLE]  # group 0's batches on one rank (ep = dp = 1)
    expected = [sum(s[0][1].values() if s[0][0] == "extend" else [1] * len(s[0][1])) > 1 for s in steps]
    _check(_scenario(ParallelGroups.single(), path, steps), expected)


def test_tbo_and_sbo_match_plain_ep2_dp2(tiny_model):
    sys.path.insert(0, str(Path(__file__).parent))
    from dist_harness import run_ranks

    per_rank = run_ranks(_scenario, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), tiny_model, STEPS)
    for rank, results in enumerate(per_rank):
        modes = [r["mode"] for r in results]
        assert "IDLE" in modes and "EXTEND" in modes, rank
        _check(results, EXPECTED_TBO)


def test_engine_with_tbo_or_sbo_generates_the_same_tokens(tiny_model):
    """End to end through the driver's decision: greedy tokens equal the plain engine's, and TBO steps ran."""
    from raymoe import Engine, SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42] * 40, [7, 8]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, opts in {"plain": {}, "sbo": {"enable_sbo": True},
                       "tbo": {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}}.items():
        with Engine(tiny_model, disable_cuda_graph=True, **opts) as e:
            outs[name] = [o.token_ids for o in e.generate(prompt_token_ids=prompts, sampling_params=params)]
            if name == "tbo":
                assert e.driver.num_tbo_steps >= 8  # the prefill and every decode step
    assert outs["tbo"] == outs["plain"] and outs["sbo"] == outs["plain"]
