"""Two-batch overlap (DeepSeek schedules: shared experts in the dispatch stage for decode, after the combine start
for prefill; a dense first layer) and single-batch overlap with shared experts give the plain path's logits and
greedy tokens on a tiny DeepSeek-V3, on one rank and on ep = dp = 2 (the scenario of ``test_tbo``)."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from test_tbo import EXPECTED_TBO, IDLE, STEPS, _check, _scenario

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ParallelConfig
from raymoe.models.checkpoint import make_checkpoint

DIMS = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 2048}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    return str(make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds") / "v3", seed=2, **DIMS))


def test_tbo_and_sbo_match_plain_single_rank(deepseek):
    steps = [(s[0],) for s in STEPS if s[0] != IDLE]
    expected = [sum(s[0][1].values() if s[0][0] == "extend" else [1] * len(s[0][1])) > 1 for s in steps]
    _check(_scenario(ParallelGroups.single(), deepseek, steps), expected)


def test_tbo_and_sbo_match_plain_ep2_dp2(deepseek):
    per_rank = run_ranks(_scenario, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), deepseek, STEPS)
    for rank, results in enumerate(per_rank):
        assert "IDLE" in [r["mode"] for r in results], rank
        _check(results, EXPECTED_TBO)
