"""Oracle parity: raymoe's single-rank engine against Hugging Face transformers (fp32) on a tiny Qwen3-MoE."""

from __future__ import annotations

import pytest
import torch

from raymoe import Engine, SamplingParams
from raymoe.runner.model_runner import ModelRunner, RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

PROMPTS = [
    "def fib(n):",
    "import os\nimport sys\n\n",
    "class Foo(object):\n    def __init__(self, x):\n        self.x = x\n",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i)\n",
    "# Licensed under the Apache License, Version 2.0\n",
    "return self._cache[key]",
]
SHARED = ("def helper(a, b, c):\n    \"\"\"Combine three values into a tuple and return it.\"\"\"\n"
          "    return (a, b, c)\n\n")
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_model):
    with Engine(tiny_model) as e:
        yield e


def hf_greedy(hf_model, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """transformers ``generate`` (greedy, stops at the checkpoint's EOS ids) for one prompt, no padding."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def reference(engine, hf_model):
    prompts = PROMPTS + [SHARED + p for p in PROMPTS[:4]]
    return {p: hf_greedy(hf_model, engine.encode(p)) for p in prompts}


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def assert_matches(outputs, prompts, reference):
    for p, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == reference[p], f"prompt {p!r}: {out.token_ids} != {reference[p]}"
        assert out.finish_reason in ("stop", "length")


def test_prefill_logits_match_transformers(tiny_model, engine, hf_model):
    runner = ModelRunner(RunnerConfig(tiny_model, "float32", num_kv_slots=1024, max_req_rows=8, max_context_len=256))
    prompts = [engine.encode(p) for p in PROMPTS[:5]]
    ids, sl, loc = [], [], []
    for p in prompts:
        loc += list(range(len(ids) + 1, len(ids) + 1 + len(p)))
        ids += p
        sl.append(len(p))
    n = len(prompts)
    batch = ModelWorkerBatch(ForwardMode.EXTEND, ids, list(range(n)), sl, [0] * n, sl, loc,
                             sampling=SamplingInputs.greedy(n))
    logits = runner.forward(runner.prepare(batch), return_all_logits=True)
    off = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0]
        assert (logits[off:off + len(p)] - ref).abs().max().item() < 1e-4
        off += len(p)


def test_greedy_generation_matches_transformers(engine, reference):
    graph_steps = engine.driver.num_graph_steps
    outs = engine.generate(PROMPTS, GREEDY)
    assert_matches(outs, PROMPTS, reference)
    assert engine.driver.num_graph_steps > graph_steps, "decode steps should replay captured graphs"


def test_chunked_prefill_matches(tiny_model, reference):
    # Also the eager decode path: graphs off.
    with Engine(tiny_model, chunked_prefill_size=5, disable_cuda_graph=True) as e:
        outs = e.generate(PROMPTS, GREEDY)
    assert_matches(outs, PROMPTS, reference)


def test_shared_prefixes_hit_radix_cache(tiny_model, reference):
    prompts = [SHARED + p for p in PROMPTS[:4]]
    with Engine(tiny_model) as e:
        first = e.generate(prompts[:1], GREEDY)
        rest = e.generate(prompts[1:], GREEDY)
        hits = e.driver.schedulers[0].tree_cache.hit_tokens
    assert_matches(first + rest, prompts, reference)
    assert hits >= 3 * len(e.encode(SHARED)) - 3
    assert sum(o.cached_tokens for o in rest) > 0


def test_small_kv_pool_forces_retraction(tiny_model, reference):
    # 8 requests need ~350 KV slots to decode side by side; 120 slots force the scheduler to retract.
    with Engine(tiny_model, max_total_tokens=120, chunked_prefill_size=64) as e:
        outs = e.generate(PROMPTS, GREEDY)
        retractions = e.driver.schedulers[0].num_retractions
    assert retractions > 0
    assert_matches(outs, PROMPTS, reference)


def test_requests_arriving_while_others_decode(tiny_model, reference):
    with Engine(tiny_model) as e:
        d = e.driver
        early = [d.add_request(d.new_rid(), e.encode(p), GREEDY) for p in PROMPTS[:3]]
        for _ in range(5):
            d.step()
        assert all(len(r.output_ids) > 0 for r in early)
        late = [d.add_request(d.new_rid(), e.encode(p), GREEDY) for p in PROMPTS[3:]]
        while d.has_unfinished():
            d.step()
        outs = [e._output(r) for r in early + late]
    assert_matches(outs, PROMPTS, reference)


def test_seeded_sampling_is_batch_independent(engine):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate(PROMPTS[0], params)[0].token_ids
    batched = engine.generate(PROMPTS, [params] + [SamplingParams(max_tokens=20, temperature=1.0)] * 7)
    assert batched[0].token_ids == alone
    again = engine.generate(PROMPTS[0], params)[0].token_ids
    assert again == alone


def test_bfloat16_runs_and_mostly_agrees(tiny_model, engine):
    p1 = SamplingParams(max_tokens=1, temperature=0.0)
    fp32 = [o.token_ids[0] for o in engine.generate(PROMPTS, p1)]
    with Engine(tiny_model, dtype="bfloat16") as e:
        outs = e.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    agree = sum(o.token_ids[0] == t for o, t in zip(outs, fp32, strict=True))
    assert agree >= 6, f"bf16 first tokens agree with fp32 on only {agree}/8 prompts"
