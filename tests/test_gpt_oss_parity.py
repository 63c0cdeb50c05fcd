"""Oracle parity with transformers (fp32) for gpt-oss on tiny checkpoints written by transformers'
``save_pretrained``: attention sinks, sliding windows of 4 and 7 tokens under prompts longer than them, GQA,
biased router and experts, the clamped SwiGLU, YaRN. Prefill logits; greedy tokens with decode graphs; chunked
prefill (chunks smaller than the prompts) with radix hits; retraction under a small KV pool."""

from __future__ import annotations

import pytest
import torch
from hf_models import GPT_OSS_CONFIGS, build
from test_deepseek_parity import GREEDY, PROMPTS, SHARED, _extend_batch, _hf_greedy, prefill_logit_error

from raymoe import Engine
from raymoe.config import GraphConfig
from raymoe.runner.model_runner import ModelRunner, RunnerConfig

NAMES = sorted(GPT_OSS_CONFIGS)


@pytest.fixture(scope="module", params=NAMES)
def hf_case(request, tmp_path_factory):
    """(name, folder, transformers model, greedy references) for each tiny gpt-oss config."""
    from transformers import AutoModelForCausalLM

    path = build(request.param, tmp_path_factory.mktemp("hf") / request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def test_prefill_logits_match_transformers(hf_case):
    _, path, hf = hf_case
    worst = prefill_logit_error(path, hf)
    assert worst <= 1e-4, worst


def test_window_changes_the_answer(hf_case, tmp_path):
    """The window is not a no-op here: the same weights with every layer full attention give other logits past
    the window (so the parity above proves the mask)."""
    _, path, _ = hf_case
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 500, (24,), generator=g).tolist()
    runner = ModelRunner(RunnerConfig(path, "float32", num_kv_slots=64, max_req_rows=2, max_context_len=64,
                                      graph=GraphConfig(disable_cuda_graph=True)))
    windowed = runner.forward(runner.prepare(_extend_batch([prompt])), return_all_logits=True)
    runner.attn_backend.windows = tuple(None for _ in runner.attn_backend.windows)
    full = runner.forward(runner.prepare(_extend_batch([prompt])), return_all_logits=True)
    assert (windowed[-1] - full[-1]).abs().max().item() > 1e-3


def test_greedy_tokens_match_transformers(hf_case):
    """32 greedy tokens for 8 prompts with decode graphs; then chunked prefill (7-token chunks) with radix hits;
    then a KV pool of 140 slots (the longest request needs about 120) that forces retraction."""
    _, path, hf = hf_case
    shared = [SHARED + q for q in PROMPTS[:3]]
    with Engine(path, max_context_len=256, max_running_requests=8) as e:
        ref = {p: _hf_greedy(hf, e.encode(p)) for p in PROMPTS + shared}
        graph_steps = e.driver.num_graph_steps
        outs = e.generate(PROMPTS, GREEDY)
        assert e.driver.num_graph_steps > graph_steps
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs, strict=True)} == {p: ref[p] for p in PROMPTS}
    with Engine(path, max_context_len=256, max_running_requests=8, chunked_prefill_size=7,
                disable_cuda_graph=True) as e:
        first = e.generate(shared[:1], GREEDY)
        rest = e.generate(shared[1:], GREEDY)
        hits = e.driver.schedulers[0].tree_cache.hit_tokens
    assert [o.token_ids for o in first + rest] == [ref[p] for p in shared]
    assert hits > 0 and sum(o.cached_tokens for o in rest) > 0
    with Engine(path, max_context_len=256, max_total_tokens=140, chunked_prefill_size=64) as e:
        outs = e.generate(PROMPTS, GREEDY)
        retractions = e.driver.schedulers[0].num_retractions
    assert retractions > 0
    assert [o.token_ids for o in outs] == [ref[p] for p in PROMPTS]
