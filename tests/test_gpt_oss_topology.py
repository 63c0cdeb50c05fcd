"""gpt-oss across topologies against transformers' greedy tokens: tp=2 (query heads and their sinks split, experts
tensor-parallel with the down bias on one rank), dp=2 ep=2 with two-batch overlap, and tp=2 dp=2 ep=4 with
two-batch overlap; decode graphs on, chunked prefill (16-token chunks, prompts up to ~30 tokens) and radix-cache
hits, a window of 8 tokens."""

from __future__ import annotations

import pytest
from hf_models import greedy_reference

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint

DIMS = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "vocab_size": 512, "sliding_window": 8}
SHARED = "class Cache(object):\n    def __init__(self, size):\n        self.size = size\n"
# The first prompt of each wave goes to DP group 0 (least loaded, ties to the lowest index): both share SHARED.
PROMPTS = [SHARED + "    def get(self, key):", "def fib(n):", "import os\n",
           SHARED + "    def put(self, key, value):", "x = [i * i for i in", "return self._cache[key]"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTS = {"max_running_requests": 4, "chunked_prefill_size": 16, "max_context_len": 128, "cuda_graph_max_bs": 4}
TBO = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    """A tiny gpt-oss folder and transformers' greedy tokens for each prompt."""
    from transformers import AutoTokenizer

    path = str(make_checkpoint("gpt_oss", tmp_path_factory.mktemp("topo") / "gpt_oss", seed=5, **DIMS))
    tok = AutoTokenizer.from_pretrained(path)
    assert max(len(tok.encode(p)) for p in PROMPTS) > DIMS["sliding_window"] + 16  # windows and chunks both bite
    return path, greedy_reference(path, PROMPTS, 12)


def test_one_rank_matches_transformers(model_and_reference):
    path, ref = model_and_reference
    with Engine(path, **OPTS) as e:
        assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == ref


@pytest.mark.parametrize(("tp", "dp", "ep", "tbo"), [(2, 1, 1, False), (1, 2, 2, True), (2, 2, 4, True)])
def test_topologies_match_transformers(ray_cluster, model_and_reference, tp, dp, ep, tbo):
    path, ref = model_and_reference
    with Engine(path, tp_size=tp, dp_size=dp, ep_size=ep, **OPTS, **(TBO if tbo else {})) as e:
        first = e.generate(PROMPTS[:3], GREEDY)
        rest = e.generate(PROMPTS[3:], GREEDY)
        graph_steps, tbo_steps = e.driver.num_graph_steps, e.driver.num_tbo_steps
    assert sum(o.cached_tokens for o in rest) > 0, "the second wave should hit the radix cache"
    assert [o.token_ids for o in first + rest] == ref
    assert graph_steps > 0
    assert (tbo_steps > 0) == tbo
