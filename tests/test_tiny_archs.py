"""``make_checkpoint`` for DeepSeek-V3/V2 and Mixtral: folders transformers loads with equal logits, configs that
normalize to the intended variants, and seeded byte-identical weights."""

from __future__ import annotations

import pytest
import torch

from raymoe.config import GraphConfig, ModelConfig
from raymoe.models.checkpoint import make_checkpoint
from raymoe.runner.model_runner import ModelRunner, RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "mixtral"])
def test_tiny_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(arch, tmp_path / arch, seed=3, **DIMS)
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    runner = ModelRunner(RunnerConfig(str(path), "float32", num_kv_slots=128, max_req_rows=2, max_context_len=64,
                                      graph=GraphConfig(disable_cuda_graph=True)))
    ids = [(7 * i + 11) % 500 + 3 for i in range(24)]
    batch = ModelWorkerBatch(ForwardMode.EXTEND, ids, [0], [24], [0], [24], list(range(1, 25)), [],
                             SamplingInputs.greedy(1))
    logits = runner.forward(runner.prepare(batch), return_all_logits=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (logits - ref).abs().max().item() <= 1e-4
    assert logits.std().item() > 2.0  # well-conditioned greedy choices


def test_tiny_configs_normalize_to_their_variants(tmp_path):
    v3 = ModelConfig.from_hf(make_checkpoint("deepseek_v3", tmp_path / "v3", **DIMS))
    assert v3.mla is not None and v3.mla.q_lora_rank == 48 and v3.mla.cache_dim == 32 + 8
    assert v3.router.scoring_func == "sigmoid" and v3.router.topk_method == "group_limited"
    assert v3.router.use_correction_bias and v3.router.n_group == 2 and v3.router.routed_scaling_factor == 2.5
    assert [v3.is_moe_layer(i) for i in range(2)] == [False, True] and v3.n_shared_experts == 1
    v2 = ModelConfig.from_hf(make_checkpoint("deepseek_v2", tmp_path / "v2", **DIMS))
    assert v2.mla.q_lora_rank is None and v2.router.scoring_func == "softmax" and v2.router.topk_method == "greedy"
    mix = ModelConfig.from_hf(make_checkpoint("mixtral", tmp_path / "mix", **DIMS))
    assert mix.mla is None and mix.router.norm_topk_prob and mix.num_experts == 8
    assert all(mix.is_moe_layer(i) for i in range(2))


def test_deepseek_moe_layer_freq_and_yarn_scale():
    base = {"model_type": "deepseek_v2", "vocab_size": 32, "hidden_size": 16, "num_attention_heads": 2,
            "num_hidden_layers": 6, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    cfg = ModelConfig.from_dict(base)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    assert cfg.mla.softmax_scale == pytest.approx(8 ** -0.5)
    yarn = ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0,
                                                           "original_max_position_embeddings": 4096}})
    m = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert yarn.mla.softmax_scale == pytest.approx(8 ** -0.5 * m * m)
    with pytest.raises(ValueError, match="topk_method"):
        ModelConfig.from_dict({**base, "topk_method": "noaux_tc"})
