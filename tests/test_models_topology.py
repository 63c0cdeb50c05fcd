"""DeepSeek-V3 and Mixtral across topologies: (tp, dp, ep) = (1, 2, 2) and (2, 2, 4), two-batch overlap on and
off, and (2, 1, 1) (experts tensor-parallel, MLA heads split), with decode graphs on, chunked prefill and
radix-cache hits, all give the single-rank engine's greedy tokens."""

from __future__ import annotations

import pytest

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint

DIMS = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}
SHARED = "class Cache(object):\n    def __init__(self, size):\n        self.size = size\n"
# The first prompt of each wave goes to DP group 0 (least loaded, ties to the lowest index): both share SHARED.
PROMPTS = [SHARED + "    def get(self, key):", "def fib(n):", "import os\n",
           SHARED + "    def put(self, key, value):", "x = [i * i for i in", "return self._cache[key]"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTS = {"max_running_requests": 4, "chunked_prefill_size": 16, "max_context_len": 128, "cuda_graph_max_bs": 4}
TBO = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}


@pytest.fixture(scope="module", params=["deepseek_v3", "mixtral"])
def model_and_reference(request, tmp_path_factory):
    path = str(make_checkpoint(request.param, tmp_path_factory.mktemp("topo") / request.param, seed=5, **DIMS))
    with Engine(path, **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    return request.param, path, ref


def _run(engine: Engine) -> list[list[int]]:
    """Requests in two waves (the second hits the first's cached prefix); returns greedy tokens per prompt."""
    first = engine.generate(PROMPTS[:3], GREEDY)
    rest = engine.generate(PROMPTS[3:], GREEDY)
    assert sum(o.cached_tokens for o in rest) > 0, "the second wave should hit the radix cache"
    return [o.token_ids for o in first + rest]


@pytest.mark.parametrize(("tp", "dp", "ep", "tbo"), [(1, 2, 2, False), (1, 2, 2, True), (2, 2, 4, False),
                                                     (2, 2, 4, True), (2, 1, 1, False)])
def test_topologies_match_single_rank(ray_cluster, model_and_reference, tp, dp, ep, tbo):
    _, path, ref = model_and_reference
    with Engine(path, tp_size=tp, dp_size=dp, ep_size=ep, **OPTS, **(TBO if tbo else {})) as e:
        outs = _run(e)
        graph_steps, tbo_steps = e.driver.num_graph_steps, e.driver.num_tbo_steps
    assert outs == ref
    assert graph_steps > 0
    assert (tbo_steps > 0) == tbo
