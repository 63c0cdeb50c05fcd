"""Oracle parity of FP8 block-quantized checkpoints: raymoe serving the FP8 folder (weights resident in FP8,
dequantized inside the CPU platform's GEMMs) against transformers (fp32) on its twin, dequantized here with the
reference semantics (weight ``[i, j]`` = fp8 ``[i, j]`` * scale ``[i // bn, j // bk]``, partial edge blocks
included). transformers' own FP8 loader cannot be the oracle: ``FineGrainedFP8Config(dequantize=True)`` derives the
block from the scale grid and gets partial blocks wrong.

DeepSeek-V3 (q_lora, group-limited sigmoid routing, shared expert, dense first layer; built by transformers) and
Qwen3-MoE (built by ``make-checkpoint --quant fp8``), both with 32 x 48 blocks that leave partial blocks at the
edges (DeepSeek's ``kv_a_proj_with_mqa`` has 40 rows, 32 + 8; hidden 64 = 48 + 16 columns), on one rank and under
dp=2 ep=2 with two-batch overlap, decode graphs and the low-latency all-to-all. Weight-only dequantization keeps
activations in float32, so the tokens must be equal.
"""

from __future__ import annotations

import pytest
import torch
from fp8_twin import dequantized_twin
from hf_models import build
from safetensors import safe_open

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint
from raymoe.models.fp8_checkpoint import quantize_folder

BLOCK = (32, 48)
PROMPTS = ["def fib(n):", "import os\nimport sys\n\n", "class Foo(object):\n    def __init__(self, x):\n", "x",
           "The quick brown fox jumps over the lazy dog. " * 2, "return self._cache[key]"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
OPTS = {"max_running_requests": 4, "max_context_len": 128, "cuda_graph_max_bs": 4}
TOPOLOGY = {"dp_size": 2, "ep_size": 2, "enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4,
            "a2a_mode": "auto"}


def _edges_are_partial(fp8) -> bool:
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        shapes = [f.get_slice(n).get_shape() for n in f.keys() if f.get_slice(n).get_dtype() == "F8_E4M3"]
    return any(n % BLOCK[0] for n, _ in shapes) or any(k % BLOCK[1] for _, k in shapes)


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def fp8_case(request, tmp_path_factory):
    """(FP8 folder, transformers' greedy tokens per prompt on the dequantized twin)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("fp8") / request.param
    if request.param == "deepseek_v3":
        fp8 = quantize_folder(build("deepseek_v3", root / "fp32"), root / "fp8", "block", BLOCK)
    else:
        fp8 = make_checkpoint("qwen3_moe", root / "fp8", seed=3, num_layers=2, hidden_size=64, head_dim=16,
                              num_experts=8, moe_intermediate_size=32, vocab_size=512, quant="fp8", fp8_block=BLOCK)
    assert _edges_are_partial(fp8)
    twin = dequantized_twin(fp8, root / "twin")
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(twin)
    ref = {}
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                              do_sample=False)
        ref[p] = out[0, ids.shape[1]:].tolist()
    return str(fp8), ref


def test_fp8_one_rank_matches_transformers_on_the_dequantized_twin(fp8_case):
    path, ref = fp8_case
    with Engine(path, **OPTS) as e:
        assert all(e.encode(p) for p in PROMPTS)
        outs = e.generate(PROMPTS, GREEDY)
        assert e.driver.num_graph_steps > 0
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs, strict=True)} == ref


def test_fp8_dp2_ep2_tbo_graphs_low_latency_match_transformers(ray_cluster, fp8_case):
    path, ref = fp8_case
    with Engine(path, **OPTS, **TOPOLOGY) as e:
        outs = e.generate(PROMPTS, GREEDY)
        d = e.driver
        counts = d.num_graph_steps, d.num_tbo_steps, d.num_low_latency_steps
    assert {p: o.token_ids for p, o in zip(PROMPTS, outs, strict=True)} == ref
    assert all(c > 0 for c in counts), counts
