"""Seeded tiny gpt-oss checkpoints (``raymoe make-checkpoint --arch gpt_oss``), under transformers' on-disk names.

Sizes come from ``TinyModelSpec``: experts of ``moe_intermediate_size`` (gpt-oss calls it ``intermediate_size``),
every layer MoE, layers alternating sliding (even) and full (odd) attention as transformers' default, a window of
``sliding_window`` tokens, YaRN rotary (factor 4 over 1,024 original positions), the released SwiGLU constants
(alpha 1.702, limit 7). With ``mxfp4`` the experts' ``gate_up_proj`` / ``down_proj`` are written as MXFP4 blocks and
scales (``raymoe.models.mxfp4``) with ``quantization_config`` ``{"quant_method": "mxfp4"}``, as the released
checkpoints ship them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from raymoe.models.mxfp4 import quantize_mxfp4
from raymoe.models.tiny_archs import _common
from raymoe.models.tiny_init import LM_HEAD_GAIN, OUT_PROJ_GAIN, ROUTER_GAIN, linear, norm

BIAS_STD = 0.5
"""Std of biases and sink logits."""


def gpt_oss_config(s) -> dict[str, Any]:
    """config.json of a tiny gpt-oss."""
    cfg = _common(s, "GptOssForCausalLM", "gpt_oss")
    cfg.update({"intermediate_size": s.moe_intermediate_size, "num_key_value_heads": s.num_kv_heads,
                "head_dim": s.head_dim, "num_local_experts": s.num_experts,
                "num_experts_per_tok": s.num_experts_per_tok, "attention_bias": True,
                "sliding_window": s.sliding_window, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.num_layers)],
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1024},
                "output_router_logits": False, "router_aux_loss_coef": 0.9})
    if s.mxfp4:
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return cfg


def _bias(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return BIAS_STD * torch.randn(*shape, generator=gen)


def _experts(s, gen: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    h, i, e = s.hidden_size, s.moe_intermediate_size, s.num_experts
    gate_up = torch.stack([linear(gen, 2 * i, h).t() for _ in range(e)])                   # [E, H, 2 I]
    down = torch.stack([linear(gen, h, i, OUT_PROJ_GAIN).t() for _ in range(e)])           # [E, I, H]
    t = {prefix + "gate_up_proj_bias": _bias(gen, e, 2 * i), prefix + "down_proj_bias": _bias(gen, e, h)}
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        if s.mxfp4:
            t[prefix + name + "_blocks"], t[prefix + name + "_scales"] = quantize_mxfp4(w)
        else:
            t[prefix + name] = w
    return t


def gpt_oss_weights(s, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Weights in build steps: embeddings, one dict per layer, final norm + LM head."""
    h, d = s.hidden_size, s.head_dim
    yield {"model.embed_tokens.weight": torch.randn(s.vocab_size, h, generator=gen)}
    for layer in range(s.num_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        t = {p + "input_layernorm.weight": norm(gen, h), p + "post_attention_layernorm.weight": norm(gen, h),
             a + "q_proj.weight": linear(gen, s.num_heads * d, h), a + "q_proj.bias": _bias(gen, s.num_heads * d),
             a + "k_proj.weight": linear(gen, s.num_kv_heads * d, h), a + "k_proj.bias": _bias(gen, s.num_kv_heads * d),
             a + "v_proj.weight": linear(gen, s.num_kv_heads * d, h), a + "v_proj.bias": _bias(gen, s.num_kv_heads * d),
             a + "o_proj.weight": linear(gen, h, s.num_heads * d, OUT_PROJ_GAIN), a + "o_proj.bias": _bias(gen, h),
             a + "sinks": _bias(gen, s.num_heads),
             p + "mlp.router.weight": linear(gen, s.num_experts, h, ROUTER_GAIN),
             p + "mlp.router.bias": _bias(gen, s.num_experts)}
        t.update(_experts(s, gen, p + "mlp.experts."))
        yield t
    last = {"model.norm.weight": norm(gen, h)}
    if not s.tie_word_embeddings:
        last["lm_head.weight"] = linear(gen, s.vocab_size, h, LM_HEAD_GAIN)
    yield last
