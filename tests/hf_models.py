"""Tiny checkpoints built by transformers itself (``save_pretrained``), for oracle parity tests.

transformers initializes with std 0.02, which makes tiny models' greedy choices near-ties; ``build`` therefore
re-draws every weight from a seeded generator with fan-in scaled gains (as ``raymoe.models.checkpoint`` does) and
gives DeepSeek-V3's ``e_score_correction_bias`` random values, then lets transformers write the folder (its own
names and config.json). A trained tokenizer of the same vocabulary is added so the engine can run on it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from raymoe.models.tokenizer_builder import ENDOFTEXT_ID, IM_END_ID, build_tokenizer

VOCAB = 512
_COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "bos_token_id": ENDOFTEXT_ID,
           "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID, "tie_word_embeddings": False}
_MLA = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1}
_GPT_OSS = {"num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 8,
            "num_experts_per_tok": 2, "swiglu_limit": 1.5,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}}

CONFIGS = {
    "deepseek_v3": ("deepseek_v3", {**_MLA, "q_lora_rank": 24, "num_hidden_layers": 3, "first_k_dense_replace": 1,
                                    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                                    "norm_topk_prob": True}),
    "deepseek_v2_no_q_lora": ("deepseek_v2", {**_MLA, "q_lora_rank": None, "num_hidden_layers": 3,
                                              "first_k_dense_replace": 1, "n_shared_experts": 2,
                                              "routed_scaling_factor": 1.0, "topk_method": "greedy"}),
    "deepseek_v2_q_lora": ("deepseek_v2", {**_MLA, "q_lora_rank": 24, "num_hidden_layers": 2,
                                           "first_k_dense_replace": 0, "routed_scaling_factor": 1.5,
                                           "topk_method": "greedy"}),
    # YaRN rope scaling (mscale / mscale_all_dim) and group-limited routing, V2 (softmax, max group score) style.
    "deepseek_v2_yarn_grouped": ("deepseek_v2", {**_MLA, "q_lora_rank": 24, "num_hidden_layers": 2,
                                                 "first_k_dense_replace": 1, "topk_method": "group_limited_greedy",
                                                 "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0,
                                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                                     "factor": 4.0,
                                                                     "original_max_position_embeddings": 128,
                                                                     "beta_fast": 32, "beta_slow": 1,
                                                                     "mscale": 0.707, "mscale_all_dim": 0.707}}),
    # YaRN and V3's grouped sigmoid routing together.
    "deepseek_v3_yarn": ("deepseek_v3", {**_MLA, "q_lora_rank": None, "num_hidden_layers": 2,
                                         "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                                         "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0,
                                                             "factor": 4.0, "original_max_position_embeddings": 128,
                                                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                             "mscale_all_dim": 1.0}}),
    "mixtral": ("mixtral", {"num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "rope_theta": 1e6}),
}

GPT_OSS_CONFIGS = {
    # gpt-oss: sinks, biases, clamped SwiGLU (a small limit so the clamp bites), YaRN; GQA; windows of 4 and 7 tokens
    # (prompts are longer), full/sliding layers in two patterns.
    "gpt_oss_w4": ("gpt_oss", {**_GPT_OSS, "num_hidden_layers": 3, "sliding_window": 4,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "gpt_oss_w7": ("gpt_oss", {**_GPT_OSS, "num_hidden_layers": 2, "sliding_window": 7,
                               "layer_types": ["full_attention", "sliding_attention"]}),
}
"""gpt-oss cases (``tests/test_gpt_oss_parity.py``), apart from ``CONFIGS`` (DeepSeek/Mixtral parity iterates it)."""

QWEN35_CONFIGS = {
    # Qwen3.5-MoE text: full attention first and last (a pattern unlike the released every-fourth), GQA, grouped value
    # heads of a width that is not a power of two, a shared expert wider than the routed ones, a third of each head
    # rotary.
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {
        "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1 / 3}}),
    # Qwen3-Next: head-grouped in_proj_qkvz / in_proj_ba (3 value heads per key head), a dense layer
    # (mlp_only_layers), top-k weights not renormalized, linear attention first and last.
    "qwen3_next": ("qwen3_next", {
        "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 24, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "intermediate_size": 40,
        "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 16, "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 4, "mlp_only_layers": [1], "norm_topk_prob": False,
        "layer_types": ["linear_attention", "full_attention", "full_attention", "linear_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
}
"""Qwen3.5-MoE cases built by transformers (``tests/test_qwen3_5_parity.py``)."""


def _redraw(model: torch.nn.Module, seed: int, gpt_oss: bool = False) -> None:
    """Re-draw every weight (module docstring). ``gpt_oss``: biases and sink logits get std 0.5 and the experts'
    [E, in, out] projections (gpt-oss's transposed layout) their fan-in from dim -2; other families keep the rules
    their fixtures were drawn with."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if gpt_oss and name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
                continue
            if p.dim() == 1:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                continue
            router = name.endswith(("gate.weight", "router.weight"))
            gain = 6.0 if name.startswith("lm_head") else 3.0 if router else 1.0
            transposed = gpt_oss and name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            fan_in = p.shape[-2] if transposed else p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(fan_in)))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build(name: str, out: Path, seed: int = 0, overrides: dict | None = None) -> str:
    """Build ``CONFIGS[name]``, ``GPT_OSS_CONFIGS[name]`` or ``QWEN35_CONFIGS[name]`` (with ``overrides`` of its config
    fields) with
    transformers into ``out`` (weights re-drawn from ``seed``); returns the path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, kwargs = {**CONFIGS, **GPT_OSS_CONFIGS, **QWEN35_CONFIGS}[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **kwargs, **(overrides or {})})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _redraw(model, seed, gpt_oss=model_type == "gpt_oss")
    model.save_pretrained(out)
    build_tokenizer(out, vocab_size=VOCAB)
    return str(out)


def greedy_reference(path: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens (float32) for each text prompt, with the folder's own tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ref = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False)
        ref.append(out[0, ids.shape[1]:].tolist())
    return ref


def build_qwen3_5_image_text(out: Path, seed: int = 0) -> str:
    """A tiny released-format Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``, ``model_type`` ``qwen3_5_moe``:
    the language model under ``model.language_model.*`` and ``text_config``, a one-block vision tower) written by
    transformers, weights re-drawn as ``build`` does; returns the path."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    _, text = QWEN35_CONFIGS["qwen3_5_moe_text"]
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2}
    cfg = Qwen3_5MoeConfig(text_config={**_COMMON, **text}, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(out)
    build_tokenizer(out, vocab_size=VOCAB)
    return str(out)
