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


@pytest.mark.parametrize(("dp", "redundant", "rebalance", "cpu_comm"),
                         [(2, 2, False, "auto"), (2, 2, True, "auto"), (2, 0, True, "gloo"), (4, 4, True, "auto")])
def test_eplb_matches_single_rank(ray_cluster, model_and_reference, dp, redundant, rebalance, cpu_comm):
    """``cpu_comm``: auto exchanges through shared memory on this one node, gloo through torch.distributed; no
    redundant slots with rebalancing: experts only change places."""
    path, ref = model_and_reference
    opts = {**OPTS, **(REBALANCE if rebalance else {"enable_expert_distribution_metrics": True}), "cpu_comm": cpu_comm}
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


def test_a_failed_step_mid_rebalance_keeps_the_ranks_in_step(ray_cluster, model_and_reference):
    """A rank raises in a step while layers are being moved: that step's requests fail, the expert update it
    carried was applied by every rank first, and later requests (through more commits) still get the reference
    tokens."""
    import ray

    path, ref = model_and_reference
    with Engine(path, dp_size=2, ep_size=2, ep_num_redundant_experts=2, **OPTS, **REBALANCE) as e:
        e.generate(PROMPTS[:2], GREEDY)
        assert e.driver.eplb.num_rebalances > 0
        ray.get([w.inject_step_errors.remote(1) for w in e.driver.executor.workers], timeout=30)
        hit = e.generate(PROMPTS, GREEDY)
        commits = e.driver.eplb.num_layer_commits
        outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
        assert e.driver.eplb.num_layer_commits > commits
    assert any(o.finish_reason == "error" for o in hit)
    assert outs == ref
