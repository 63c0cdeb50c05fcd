"""Seeded tiny-checkpoint builders for DeepSeek-V2, DeepSeek-V3 and Mixtral (``raymoe make-checkpoint --arch``).

Each builder is a pair (``config(spec) -> config.json dict``, ``weights(spec, gen) -> build steps``) registered in
``raymoe.models.checkpoint.ARCHS``; tensors use the on-disk Hugging Face names, so the folder loads in transformers
too. Sizes come from ``TinyModelSpec``; MLA sizes derive from it: ``kv_lora_rank = hidden / 2``,
``qk_nope_head_dim = v_head_dim = head_dim``, ``qk_rope_head_dim = head_dim / 2``, and V3 has
``q_lora_rank = 3 hidden / 4`` (V2 none). DeepSeek layer 0 is dense (``first_k_dense_replace = 1``), with one
shared expert; V3 routes group-limited over 2 groups (``topk_group = 1``) with a random correction bias.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from raymoe.models.tiny_init import LM_HEAD_GAIN, OUT_PROJ_GAIN, ROUTER_GAIN, linear, norm
from raymoe.models.tokenizer_builder import ENDOFTEXT_ID, IM_END_ID


def _common(s, architecture: str, model_type: str) -> dict[str, Any]:
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": s.vocab_size,
            "hidden_size": s.hidden_size, "num_hidden_layers": s.num_layers, "num_attention_heads": s.num_heads,
            "hidden_act": "silu", "max_position_embeddings": s.max_position_embeddings, "initializer_range": 0.02,
            "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": s.tie_word_embeddings,
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": ENDOFTEXT_ID,
            "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID, "dtype": "float32"}


def _mla_dims(s, v3: bool) -> dict[str, Any]:
    return {"kv_lora_rank": s.hidden_size // 2, "q_lora_rank": 3 * s.hidden_size // 4 if v3 else None,
            "qk_nope_head_dim": s.head_dim, "qk_rope_head_dim": s.head_dim // 2, "v_head_dim": s.head_dim}


def deepseek_config(s, v3: bool) -> dict[str, Any]:
    """config.json of a tiny DeepSeek-V3 (``v3``) or DeepSeek-V2."""
    cfg = _common(s, "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM", "deepseek_v3" if v3 else "deepseek_v2")
    cfg.update(_mla_dims(s, v3))
    cfg.update({"intermediate_size": s.intermediate_size, "moe_intermediate_size": s.moe_intermediate_size,
                "n_routed_experts": s.num_experts, "num_experts_per_tok": s.num_experts_per_tok,
                "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                "num_key_value_heads": s.num_heads, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    if v3:
        cfg.update({"n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                    "rope_interleave": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    else:
        cfg.update({"n_group": None, "topk_group": None, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                    "topk_method": "greedy"})
    return cfg


def deepseek_weights(s, gen: torch.Generator, v3: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Weights in build steps: embeddings, one dict per layer, final norm + LM head."""
    h, m = s.hidden_size, _mla_dims(s, v3)
    qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    yield {"model.embed_tokens.weight": torch.randn(s.vocab_size, h, generator=gen)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t = {p + "input_layernorm.weight": norm(gen, h), p + "post_attention_layernorm.weight": norm(gen, h)}
        if m["q_lora_rank"] is None:
            t[a + "q_proj.weight"] = linear(gen, s.num_heads * qk, h)
        else:
            t[a + "q_a_proj.weight"] = linear(gen, m["q_lora_rank"], h)
            t[a + "q_a_layernorm.weight"] = norm(gen, m["q_lora_rank"])
            t[a + "q_b_proj.weight"] = linear(gen, s.num_heads * qk, m["q_lora_rank"])
        t[a + "kv_a_proj_with_mqa.weight"] = linear(gen, m["kv_lora_rank"] + m["qk_rope_head_dim"], h)
        t[a + "kv_a_layernorm.weight"] = norm(gen, m["kv_lora_rank"])
        t[a + "kv_b_proj.weight"] = linear(gen, s.num_heads * (m["qk_nope_head_dim"] + m["v_head_dim"]),
                                           m["kv_lora_rank"])
        t[a + "o_proj.weight"] = linear(gen, h, s.num_heads * m["v_head_dim"], OUT_PROJ_GAIN)
        if i == 0:  # first_k_dense_replace = 1
            t.update(_mlp(gen, p + "mlp.", h, s.intermediate_size))
        else:
            t[p + "mlp.gate.weight"] = linear(gen, s.num_experts, h, ROUTER_GAIN)
            if v3:
                t[p + "mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(s.num_experts, generator=gen)
            for e in range(s.num_experts):
                t.update(_mlp(gen, f"{p}mlp.experts.{e}.", h, s.moe_intermediate_size))
            t.update(_mlp(gen, p + "mlp.shared_experts.", h, s.moe_intermediate_size))
        yield t
    last = {"model.norm.weight": norm(gen, h)}
    if not s.tie_word_embeddings:
        last["lm_head.weight"] = linear(gen, s.vocab_size, h, LM_HEAD_GAIN)
    yield last


def _mlp(gen: torch.Generator, prefix: str, h: int, inter: int, names=("gate_proj", "up_proj", "down_proj")):
    return {f"{prefix}{names[0]}.weight": linear(gen, inter, h), f"{prefix}{names[1]}.weight": linear(gen, inter, h),
            f"{prefix}{names[2]}.weight": linear(gen, h, inter, OUT_PROJ_GAIN)}


def mixtral_config(s) -> dict[str, Any]:
    """config.json of a tiny Mixtral (experts of ``moe_intermediate_size``; every layer sparse)."""
    cfg = _common(s, "MixtralForCausalLM", "mixtral")
    cfg.update({"intermediate_size": s.moe_intermediate_size, "num_key_value_heads": s.num_kv_heads,
                "head_dim": s.head_dim, "num_local_experts": s.num_experts,
                "num_experts_per_tok": s.num_experts_per_tok,
                "rope_theta": 1000000.0, "sliding_window": None, "router_jitter_noise": 0.0,
                "output_router_logits": False, "router_aux_loss_coef": 0.001})
    return cfg


def mixtral_weights(s, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Weights in build steps (``block_sparse_moe.experts.E.w1/w3/w2``: gate/up/down)."""
    h, d = s.hidden_size, s.head_dim
    yield {"model.embed_tokens.weight": torch.randn(s.vocab_size, h, generator=gen)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": norm(gen, h), p + "post_attention_layernorm.weight": norm(gen, h),
             p + "self_attn.q_proj.weight": linear(gen, s.num_heads * d, h),
             p + "self_attn.k_proj.weight": linear(gen, s.num_kv_heads * d, h),
             p + "self_attn.v_proj.weight": linear(gen, s.num_kv_heads * d, h),
             p + "self_attn.o_proj.weight": linear(gen, h, s.num_heads * d, OUT_PROJ_GAIN),
             p + "block_sparse_moe.gate.weight": linear(gen, s.num_experts, h, ROUTER_GAIN)}
        for e in range(s.num_experts):
            t.update(_mlp(gen, f"{p}block_sparse_moe.experts.{e}.", h, s.moe_intermediate_size, ("w1", "w3", "w2")))
        yield t
    last = {"model.norm.weight": norm(gen, h)}
    if not s.tie_word_embeddings:
        last["lm_head.weight"] = linear(gen, s.vocab_size, h, LM_HEAD_GAIN)
    yield last
