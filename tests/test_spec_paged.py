"""Speculative decoding on a paged KV cache through the flash_attn backend (vLLM's kernel as on CUDA, here its
strict CPU double, pages of 16 tokens: a block-table kernel reads a row's keys page by page, so the draft slots of a
verify step must keep each aligned run of 16 positions in one page): greedy tokens equal plain decoding's with
``ngram`` drafts (Qwen3-MoE) and with the MTP layer's ``nextn`` drafts (Qwen3.5-MoE, whose full-attention layers and
MTP layer read the paged cache). Decode graphs of up to 8 rows are on: verify steps of up to 8 tokens replay them as
one decode row per token (the block-table decode kernel), larger ones run the extend kernel."""

from __future__ import annotations

import pytest
from test_flash_attn import fa_double  # noqa: F401 - the fixture
from test_spec_engine import DIMS, GREEDY, OPTS, PROMPTS, spec_counters

from raymoe import Engine
from raymoe.models.checkpoint import make_checkpoint

CASES = {"ngram": ("qwen3_moe", {}), "nextn": ("qwen3_5_moe", {"mtp_layers": 1})}


@pytest.mark.parametrize("algo", sorted(CASES))
def test_verify_steps_on_pages_of_16_keep_the_tokens(tmp_path, fa_double, algo):  # noqa: F811
    arch, extra = CASES[algo]
    dims = {k: v for k, v in DIMS.items() if k != "intermediate_size"} if arch == "qwen3_5_moe" else DIMS
    path = str(make_checkpoint(arch, tmp_path / arch, seed=3, **dims, **extra))
    opts = {**OPTS, "disable_cuda_graph": True}
    with Engine(path, **opts) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    calls = fa_double.calls
    graphs = {**opts, "disable_cuda_graph": False, "cuda_graph_max_bs": 8}
    with Engine(path, attention_backend="flash_attn", **graphs, speculative_algorithm=algo, speculative_num_steps=3,
                speculative_draft_policy="fixed") as e:
        assert e.config.cache.page_size == 16
        outs = e.generate(PROMPTS, GREEDY)
        counters = spec_counters(e)
        verify_graphs = e.driver.executor.worker.runner.verify_graph_steps
        e.driver.schedulers[0].check_memory_invariants()
    assert fa_double.calls > calls
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and counters.draft_tokens > 0, counters
    if algo == "ngram":  # Qwen3.5's recurrent layers verify eagerly
        assert 0 < verify_graphs < counters.verify_steps, (verify_graphs, counters)
