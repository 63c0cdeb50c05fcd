"""Qwen3.5-MoE across topologies against transformers' greedy tokens: one rank; tp=2 (linear-attention key and value
heads, their conv channels and states split; gated attention's query/gate pairs split); dp=2 ep=2 (DP attention:
each group's ranks keep their own requests' recurrent states; IDLE batches while one group waits) with and without
two-batch overlap (split by sequence: the states stay per request); decode graphs on, chunked prefill (16-token
chunks, prompts up to ~30 tokens)."""

from __future__ import annotations

import pytest
from hf_models import greedy_reference
from test_models_topology import GREEDY, OPTS, PROMPTS, TBO

from raymoe import Engine
from raymoe.models.checkpoint import make_checkpoint
from raymoe.tokenizer import load_tokenizer

DIMS = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "vocab_size": 512}


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    """A tiny Qwen3.5-MoE folder and transformers' greedy tokens for each prompt."""
    path = str(make_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("topo") / "q35", seed=5, **DIMS))
    tok = load_tokenizer(path)
    assert max(len(tok.encode(p)) for p in PROMPTS) > OPTS["chunked_prefill_size"]  # chunks bite
    return path, greedy_reference(path, PROMPTS, GREEDY.max_tokens)


def test_one_rank_matches_transformers(model_and_reference):
    path, ref = model_and_reference
    with Engine(path, **OPTS) as e:
        assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == ref


@pytest.mark.parametrize(("tp", "dp", "ep", "tbo"), [(2, 1, 1, False), (1, 2, 2, False), (1, 2, 2, True)])
def test_topologies_match_transformers(ray_cluster, model_and_reference, tp, dp, ep, tbo):
    path, ref = model_and_reference
    with Engine(path, tp_size=tp, dp_size=dp, ep_size=ep, **OPTS, **(TBO if tbo else {})) as e:
        outs = e.generate(PROMPTS, GREEDY)
        graph_steps, tbo_steps = e.driver.num_graph_steps, e.driver.num_tbo_steps
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs] == ref
    assert graph_steps > 0 and (tbo_steps > 0) == tbo
    assert (report.leaked_kv_slots, report.leaked_req_rows) == (0, 0)


def test_served_by_the_engine_client_with_serve_defaults(ray_cluster, model_and_reference):
    """``raymoe serve``'s engine (its defaults: dp=2 ep=2, the driver actor) applies the family's rules (radix hits
    off) and streams transformers' tokens."""
    import asyncio

    from raymoe.client.engine_client import EngineClient
    from raymoe.deploy.server_config import ServeOptions

    path, ref = model_and_reference
    opts = ServeOptions(model=path, max_running_requests=4, max_context_len=128)
    client = EngineClient(opts.engine_config(path))
    try:
        assert not client.config.cache.enable_radix_cache and client.config.parallel.dp_size == 2

        async def run(i, prompt):
            out = []
            async for d in client.generate(f"r{i}", client.tokenizer.encode(prompt), GREEDY):
                out += d.token_ids
            return out

        async def main():
            return await asyncio.gather(*(run(i, p) for i, p in enumerate(PROMPTS)))

        assert asyncio.run(main()) == ref
    finally:
        client.shutdown()


def test_expert_parallel_load_balancing_keeps_the_tokens(ray_cluster, model_and_reference):
    """Redundant expert slots and rebalances while requests decode (``raymoe.eplb``): each rank's MoE blocks load
    the experts its slots name (the model builds them from the expert location, as ``build_mlp`` does), so the
    tokens stay transformers'."""
    from test_eplb_parity import REBALANCE

    path, ref = model_and_reference
    with Engine(path, dp_size=2, ep_size=2, ep_num_redundant_experts=2, **OPTS, **REBALANCE) as e:
        outs = e.generate(PROMPTS, GREEDY)
        eplb = e.driver.eplb
        commits, moved = eplb.num_layer_commits, eplb.location != eplb.initial
    assert [o.token_ids for o in outs] == ref
    assert commits >= 1 and moved
