"""Expert-parallel load balancing keeps greedy outputs: redundant expert slots, and placements switched layer by
layer while requests are mid-generation (rebalances every few steps, weights moved between ranks in the
background), give the single-rank engine's tokens for Qwen3-MoE and DeepSeek-V3 at dp=2 ep=2 and dp=4 ep=4, with
two-batch overlap, decode graphs and the low-latency all-to-all on."""

from __future__ import annotations

import pytest

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint

DIMS = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}
PROMPTS = ["def fib(n):", "import os\n", "class Cache(object):\n    def get(self, key):", "x = [i * i for i in",
           "return self._cache[key]", "while True:"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
OPTS = {"max_running_requests": 4, "chunked_prefill_size": 16, "max_context_len": 128, "cuda_graph_max_bs": 4,
        "enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}
# a rebalance every 3 steps from a window of every step's counts, one expert copy per rank and step: layers switch
# one after another while the requests decode
REBALANCE = {"enable_eplb": True, "eplb_rebalance_num_iterations": 3, "eplb_record_interval": 1,
             "eplb_min_window_tokens": 1, "eplb_transfer_experts_per_step": 1}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model_and_reference(request, tmp_path_factory):
    path = str(make_checkpoint(request.param, tmp_path_factory.mktemp("eplb") / request.param, seed=7, **DIMS))
    with Engine(path, **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    return path, ref


@pytest.mark.parametrize(("dp", "redundant", "rebalance"), [(2, 2, False), (2, 2, True), (4, 4, True)])
def test_eplb_matches_single_rank(ray_cluster, model_and_reference, dp, redundant, rebalance):
    path, ref = model_and_reference
    opts = {**OPTS, **(REBALANCE if rebalance else {"enable_expert_distribution_metrics": True})}
    with Engine(path, dp_size=dp, ep_size=dp, ep_num_redundant_experts=redundant, **opts) as e:
        outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
        d = e.driver
        counts = (d.num_graph_steps, d.num_tbo_steps, d.num_low_latency_steps)
        eplb = d.eplb
        load = eplb.window_load()
    assert outs == ref
    assert min(counts) > 0, f"graph, TBO and low-latency steps: {counts}"
    assert int(load.sum()) > 0  # the ranks' counters reached the driver
    if rebalance:
        assert eplb.num_layer_commits >= 2, "layers should switch while the requests decode"
        assert eplb.location != eplb.initial
