"""Qwen3.5-MoE (hybrid Gated DeltaNet + gated full attention + MoE with a gated shared expert) against transformers
(fp32) on a seeded tiny checkpoint (``make_checkpoint("qwen3_5_moe")``: linear, linear, full, linear layers, GQA,
grouped value heads, a quarter of each head rotary, zero-centered norms).

Checked: prefill logits of four prompts in one batch (fresh states per row); greedy tokens of 3 and 8 prompts
with decode graphs (padding rows of a bucket must not write a live request's state); chunked
prefill with chunks smaller than the prompts (the conv and recurrent states carried across chunks, MIXED steps);
retraction under a small KV pool (a retracted request re-prefills from zeros); no state row leaks (the idle
invariant); the engine switches radix hits off for this family and refuses a TP size that does not divide the
linear-attention heads, and PD, by name.
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_parity import GREEDY, PROMPTS, SHARED, _hf_greedy, prefill_logit_error

from raymoe import Engine
from raymoe.errors import InvalidRequestError


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from raymoe.models.checkpoint import make_checkpoint

    path = str(make_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("q35") / "q35", seed=0, num_layers=4))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_prefill_logits_match_transformers(case):
    path, hf = case
    worst = prefill_logit_error(path, hf)
    # logits reach |25| here; the chunked delta rule solves its triangular systems in another order than
    # transformers' (measured 3.3e-4 at 40 tokens, 8e-5 below 20: float32 rounding, 1e-5 relative)
    assert worst <= 1e-3, worst


def test_greedy_tokens_match_transformers_with_chunks_mixed_steps_and_retraction(case):
    path, hf = case
    prompts = PROMPTS + [SHARED + q for q in PROMPTS[:2]]
    with Engine(path, max_context_len=256, max_running_requests=8) as e:
        ref = {p: _hf_greedy(hf, e.encode(p)) for p in prompts}
        assert not e.config.cache.enable_radix_cache  # the family's rule: no prefix hits
        three = e.generate(PROMPTS[:3], GREEDY)  # decode graphs of bucket 4: a padding row reads table row 0
        graph_steps = e.driver.num_graph_steps
        outs = e.generate(PROMPTS, GREEDY)
        assert e.driver.idle_report().leaked_req_rows == 0
    assert graph_steps > 0 and [o.token_ids for o in three] == [ref[p] for p in PROMPTS[:3]]
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs, strict=True)} == {p: ref[p] for p in PROMPTS}
    with Engine(path, max_context_len=256, max_running_requests=8, chunked_prefill_size=7,
                enable_mixed_chunk=True) as e:
        outs = e.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [ref[p] for p in prompts]
    with Engine(path, max_context_len=256, max_total_tokens=140, chunked_prefill_size=64) as e:
        outs = e.generate(PROMPTS, GREEDY)
        retractions = e.driver.schedulers[0].num_retractions
        report = e.driver.idle_report()
    assert retractions > 0
    assert [o.token_ids for o in outs] == [ref[p] for p in PROMPTS]
    assert (report.leaked_kv_slots, report.leaked_req_rows) == (0, 0)


def test_a_checkpoint_written_by_transformers_matches_it(tmp_path):
    """Another layer pattern (full attention first and last), a shared expert wider than the routed experts, head
    widths that are not powers of two, a third of each head rotary; the folder written by transformers itself."""
    from hf_models import build
    from transformers import AutoModelForCausalLM

    path = build("qwen3_5_moe_text", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert prefill_logit_error(path, hf) <= 5e-3  # logits reach |47| (norm weights near 2): 5e-5 relative
    with Engine(path, max_context_len=256, max_running_requests=8, chunked_prefill_size=9) as e:
        ref = [_hf_greedy(hf, e.encode(p)) for p in PROMPTS]
        outs = e.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref


def test_a_released_format_image_text_checkpoint_serves_its_language_model(tmp_path):
    """``model_type: qwen3_5_moe`` (``Qwen3_5MoeForConditionalGeneration``): the language model's keys under
    ``text_config`` and its tensors under ``model.language_model.*`` beside a vision tower; the engine reads the
    language model and answers text prompts as transformers' image-text model does."""
    from hf_models import build_qwen3_5_image_text
    from transformers import Qwen3_5MoeForConditionalGeneration

    path = build_qwen3_5_image_text(tmp_path / "mm")
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with Engine(path, max_context_len=256, max_running_requests=8) as e:
        assert e.model_config.model_type == "qwen3_5_moe" and e.model_config.hybrid is not None
        ref = [_hf_greedy(hf, e.encode(p)) for p in PROMPTS[:4]]
        outs = e.generate(PROMPTS[:4], GREEDY)
    assert [o.token_ids for o in outs] == ref


def test_indivisible_tensor_parallelism_and_pd_are_refused_by_name(case):
    path, _ = case
    with pytest.raises(InvalidRequestError) as e:
        Engine(path, tp_size=4)  # 2 key heads
    assert e.value.field == "tp_size"
    from raymoe.client.pd_config import pd_engine_configs

    with pytest.raises(InvalidRequestError) as e:
        pd_engine_configs(path, {}, "dp=1", "dp=1")
    assert e.value.field == "pd_prefill"


def test_state_rows_are_reused_after_aborts_and_finishes_without_leaks(case):
    """Requests aborted mid-decode and finished ones give their rows back (the idle invariant covers the state rows:
    they are the ReqToTokenPool rows); requests admitted into those rows afterwards start from zero states and give
    transformers' tokens."""
    from raymoe.kvcache.state_pool import RecurrentStatePool
    from raymoe.scheduler.sampling_params import SamplingParams

    path, hf = case
    with Engine(path, max_context_len=256, max_running_requests=2) as e:
        pool: RecurrentStatePool = e.driver.executor.worker.runner.state_pool
        assert pool.rows == e.config.scheduler.req_pool_rows and pool.conv.shape[1] == pool.rows + 1
        assert pool.nbytes() == (pool.rows + 1) * RecurrentStatePool.bytes_per_row(pool.config, pool.num_layers)
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:2]):
            e.driver.submit(f"a{i}", e.encode(p), long)
        for _ in range(6):
            e.driver.step()
        assert bool(pool.ssm.abs().sum() > 0)  # the rows hold live states now
        for i in range(2):
            e.driver.abort_request(f"a{i}")
        while e.driver.has_unfinished():
            e.driver.step()
        outs = e.generate(PROMPTS[2:6], GREEDY)  # into the aborted requests' rows, two at a time
        report = e.driver.idle_report()
        ref = [_hf_greedy(hf, e.encode(p)) for p in PROMPTS[2:6]]
    assert [o.token_ids for o in outs] == ref
    assert (report.leaked_kv_slots, report.leaked_req_rows, report.locked_cache_tokens) == (0, 0, 0)
