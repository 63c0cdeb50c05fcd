"""``swa_kv_eviction``: gpt-oss's sliding-window layers keep their KV in per-row rings of ``sliding_window`` slots
(``raymoe.kvcache.swa_ring``, ``raymoe.attention.swa_ring``) against transformers (fp32) on the tiny checkpoints
written by transformers (windows of 4 and 7 tokens, prompts far longer).

Checked: the token pool holds the full layers only and the rings ``rows x window`` slots; greedy tokens equal
transformers' with decode graphs (padding rows of a bucket), with chunked prefill in chunks longer than the window
and MIXED steps, and under retraction; tp=2, and dp=2 ep=2 with two-batch overlap; ngram verify steps (the rings'
slack for drafts); the option's rules (radix hits off, models without sliding layers refused by name).
"""

from __future__ import annotations

import pytest
import torch
from hf_models import GPT_OSS_CONFIGS, build
from test_deepseek_parity import GREEDY, PROMPTS, SHARED, _hf_greedy
from test_models_topology import TBO

from raymoe import Engine
from raymoe.errors import InvalidRequestError

NAMES = sorted(GPT_OSS_CONFIGS)


@pytest.fixture(scope="module", params=NAMES)
def hf_case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build(request.param, tmp_path_factory.mktemp("swa") / request.param)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_ring_layout_and_greedy_tokens_match_transformers(hf_case):
    path, hf = hf_case
    prompts = PROMPTS + [SHARED + q for q in PROMPTS[:2]]
    with Engine(path, max_context_len=256, max_running_requests=8, swa_kv_eviction=True) as e:
        assert not e.config.cache.enable_radix_cache
        ref = {p: _hf_greedy(hf, e.encode(p)) for p in prompts}
        three = e.generate(PROMPTS[:3], GREEDY)  # a bucket of 4: one padding row
        outs = e.generate(PROMPTS, GREEDY)
        graph_steps, report = e.driver.num_graph_steps, e.driver.idle_report()
    assert graph_steps > 0
    assert [o.token_ids for o in three] == [ref[p] for p in PROMPTS[:3]]
    assert [o.token_ids for o in outs] == [ref[p] for p in PROMPTS]
    assert (report.leaked_kv_slots, report.leaked_req_rows) == (0, 0)
    # chunks of 9 (longer than either window) with MIXED steps, then a pool small enough to retract
    with Engine(path, max_context_len=256, max_running_requests=8, chunked_prefill_size=9, enable_mixed_chunk=True,
                swa_kv_eviction=True) as e:
        outs = e.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [ref[p] for p in prompts]
    with Engine(path, max_context_len=256, max_total_tokens=140, chunked_prefill_size=64,
                swa_kv_eviction=True) as e:
        outs = e.generate(PROMPTS, GREEDY)
        retractions = e.driver.schedulers[0].num_retractions
    assert retractions > 0 and [o.token_ids for o in outs] == [ref[p] for p in PROMPTS]


def test_the_pools_hold_the_full_layers_and_one_window_per_row(hf_case):
    from raymoe.config import GraphConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig

    path, hf = hf_case
    cfg = hf.config
    sliding = sum(t == "sliding_attention" for t in cfg.layer_types)
    runner = ModelRunner(RunnerConfig(path, "float32", num_kv_slots=64, max_req_rows=3, max_context_len=64,
                                      graph=GraphConfig(disable_cuda_graph=True), swa_kv_eviction=True))
    assert len(runner.token_to_kv_pool.k_buffer) == cfg.num_hidden_layers - sliding
    ring = runner.state_pool
    assert ring.num_layers == sliding and ring.k_buffer[0].shape[0] == 3 * cfg.sliding_window + 1


@pytest.mark.parametrize(("tp", "dp", "ep", "tbo"), [(2, 1, 1, False), (1, 2, 2, True)])
def test_topologies(ray_cluster, hf_case, tp, dp, ep, tbo):
    """tp=2 (each rank's ring holds its kv heads) and dp=2 ep=2 with two-batch overlap (split by sequence)."""
    path, hf = hf_case
    with Engine(path, tp_size=tp, dp_size=dp, ep_size=ep, max_running_requests=4, chunked_prefill_size=16,
                max_context_len=128, cuda_graph_max_bs=4, swa_kv_eviction=True, **(TBO if tbo else {})) as e:
        ref = [_hf_greedy(hf, e.encode(p)) for p in PROMPTS[:6]]
        outs = e.generate(PROMPTS[:6], GREEDY)
        tbo_steps = e.driver.num_tbo_steps
    assert (tbo_steps > 0) == tbo and [o.token_ids for o in outs] == ref


def test_speculative_verify_steps_keep_the_tokens(hf_case):
    """ngram drafts verified every step: the rings have room for the drafts (``slack``), so a rejected draft never
    overwrites a position the next window reads; the tokens are plain decoding's."""
    from test_spec_engine import spec_counters

    path, hf = hf_case
    prompts = [p * 3 for p in PROMPTS[:4]]  # repeated text: drafts to verify
    with Engine(path, max_context_len=256, max_running_requests=4, swa_kv_eviction=True,
                speculative_algorithm="ngram", speculative_num_steps=3, speculative_draft_policy="fixed") as e:
        ref = [_hf_greedy(hf, e.encode(p)) for p in prompts]
        outs = e.generate(prompts, GREEDY)
        counters = spec_counters(e)
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and counters.draft_tokens > counters.verify_steps, counters


def test_rules_name_the_option(tmp_path):
    from raymoe.models.checkpoint import make_checkpoint

    qwen = str(make_checkpoint("qwen3_moe", tmp_path / "q", seed=0, num_layers=2))
    with pytest.raises(InvalidRequestError, match="swa_kv_eviction"):
        Engine(qwen, max_context_len=64, swa_kv_eviction=True)

