"""Qwen3-Next against transformers (fp32) on a checkpoint transformers writes itself (``hf_models.build("qwen3_next")``:
head-grouped ``in_proj_qkvz`` / ``in_proj_ba`` with 3 value heads per key head, a dense layer among MoE layers,
top-k weights not renormalized, linear attention first and last).

Checked: the regrouping of the fused projections row for row against transformers' own split; prefill logits; greedy
tokens with chunked prefill (chunks of 9), MIXED steps and decode graphs on one rank; tp=2 (heads split across the
regrouped rows) and dp=2 ep=2 with two-batch overlap on Ray ranks; served by the engine client with serve defaults.
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_parity import GREEDY, PROMPTS, _hf_greedy, prefill_logit_error
from test_models_topology import TBO

from raymoe import Engine
from raymoe.config import ModelConfig
from raymoe.models.loader import CheckpointReader
from raymoe.models.qwen3_next import GroupedProjectionNames


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from hf_models import build
    from transformers import AutoModelForCausalLM

    path = build("qwen3_next", tmp_path_factory.mktemp("q3next") / "hf")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_the_grouped_projections_regroup_as_transformers_splits_them(case):
    path, hf = case
    config = ModelConfig.from_dict(hf.config.to_dict())
    assert config.is_linear_layer(0) and not config.is_moe_layer(1) and not config.router.norm_topk_prob
    view = GroupedProjectionNames(CheckpointReader(path), config.hybrid.linear)
    layer = hf.model.layers[0].linear_attn
    x = torch.randn(1, 5, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
    p = "model.layers.0.linear_attn."
    mine = {n: x[0] @ view.get(p + f"in_proj_{n}.weight").T for n in ("qkv", "z", "b", "a")}
    theirs = {"qkv": torch.cat([t.reshape(5, -1) for t in (q[0], k[0], v[0])], dim=-1), "z": z[0].reshape(5, -1),
              "b": b[0], "a": a[0]}
    for n, ref in theirs.items():
        assert view.shape(p + f"in_proj_{n}.weight") == (ref.shape[-1], hf.config.hidden_size)
        torch.testing.assert_close(mine[n], ref, rtol=1e-5, atol=1e-5, msg=n)
        assert p + f"in_proj_{n}.weight" in view
    assert "model.layers.1.linear_attn.in_proj_z.weight" not in view  # layer 1 is full attention


def test_prefill_and_greedy_tokens_match_transformers_with_chunks_and_graphs(case):
    path, hf = case
    assert prefill_logit_error(path, hf) <= 5e-3  # logits reach |40| (norm weights near 2): 1e-4 relative
    with Engine(path, max_context_len=256, max_running_requests=8, chunked_prefill_size=9,
                enable_mixed_chunk=True) as e:
        ref = [_hf_greedy(hf, e.encode(p)) for p in PROMPTS]
        outs = e.generate(PROMPTS, GREEDY)
        graph_steps, report = e.driver.num_graph_steps, e.driver.idle_report()
    assert graph_steps > 0 and [o.token_ids for o in outs] == ref
    assert (report.leaked_kv_slots, report.leaked_req_rows) == (0, 0)


@pytest.mark.parametrize(("tp", "dp", "ep", "tbo"), [(2, 1, 1, False), (1, 2, 2, True)])
def test_topologies_match_transformers(ray_cluster, case, tp, dp, ep, tbo):
    path, hf = case
    with Engine(path, tp_size=tp, dp_size=dp, ep_size=ep, max_running_requests=4, chunked_prefill_size=16,
                max_context_len=128, cuda_graph_max_bs=4, **(TBO if tbo else {})) as e:
        ref = [_hf_greedy(hf, e.encode(p)) for p in PROMPTS]
        outs = e.generate(PROMPTS, GREEDY)
        graph_steps, tbo_steps = e.driver.num_graph_steps, e.driver.num_tbo_steps
    assert [o.token_ids for o in outs] == ref
    assert graph_steps > 0 and (tbo_steps > 0) == tbo


def test_make_checkpoint_qwen3_next_gives_the_tokens_of_its_qwen3_5_twin(tmp_path):
    """``make-checkpoint --arch qwen3_next`` writes the Qwen3.5 tensors of the same seed fused as Qwen3-Next stores
    them: transformers reads it as Qwen3-Next and raymoe gives its tokens, and those of the Qwen3.5 twin for the same
    token ids (transformers tokenizes the two folders differently: it picks a Qwen3.5 tokenizer class by
    ``model_type``)."""
    from transformers import AutoModelForCausalLM

    from raymoe.models.checkpoint import make_checkpoint

    nxt = str(make_checkpoint("qwen3_next", tmp_path / "next", seed=3, num_layers=3))
    twin = str(make_checkpoint("qwen3_5_moe", tmp_path / "q35", seed=3, num_layers=3))
    hf = AutoModelForCausalLM.from_pretrained(nxt, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    with Engine(nxt, max_context_len=128, max_running_requests=4) as e:
        ids = [e.encode(p) for p in PROMPTS[:3]]
        ref = [_hf_greedy(hf, i) for i in ids]
        mine = [o.token_ids for o in e.generate(None, GREEDY, prompt_token_ids=ids)]
    with Engine(twin, max_context_len=128, max_running_requests=4) as e:
        twin_tokens = [o.token_ids for o in e.generate(None, GREEDY, prompt_token_ids=ids)]
    assert mine == ref == twin_tokens


def test_served_by_the_engine_client_with_serve_defaults(ray_cluster, case):
    """``raymoe serve``'s engine (its defaults: dp=2 ep=2 on rank actors, the driver actor) streams transformers'
    greedy tokens for Qwen3-Next, with the family's rules applied (radix hits off)."""
    import asyncio

    from raymoe.client.engine_client import EngineClient
    from raymoe.deploy.server_config import ServeOptions

    path, hf = case
    client = EngineClient(ServeOptions(model=path, max_running_requests=4, max_context_len=128).engine_config(path))
    try:
        assert not client.config.cache.enable_radix_cache and client.config.parallel.dp_size == 2
        ids = [client.tokenizer.encode(p) for p in PROMPTS[:4]]

        async def run(i, prompt_ids):
            out = []
            async for d in client.generate(f"r{i}", prompt_ids, GREEDY):
                out += d.token_ids
            return out

        async def main():
            return await asyncio.gather(*(run(i, p) for i, p in enumerate(ids)))

        assert asyncio.run(main()) == [_hf_greedy(hf, p) for p in ids]
    finally:
        client.shutdown()
