"""Seeded tiny Qwen3.5-MoE text checkpoints (``raymoe make-checkpoint --arch qwen3_5_moe``), under transformers' on-disk
names (``Qwen3_5MoeForCausalLM``, ``model_type`` ``qwen3_5_moe_text``), and Qwen3-Next ones (``--arch qwen3_next``:
the same tensors with the linear-attention projections fused as ``Qwen3NextForCausalLM`` stores them).

Sizes come from ``TinyModelSpec``: ``num_layers`` layers, a full-attention layer every third (``layer_types``: linear,
linear, full, ...; not the released every-fourth, so both kinds sit at several depths), GQA heads of ``head_dim``
with a quarter of each head rotary; Gated DeltaNet layers with ``num_kv_heads`` key heads and ``num_heads`` value
heads of ``head_dim / 2`` (grouped values), a 4-wide causal conv; every layer MoE with a shared expert of
``moe_intermediate_size``. Zero-centered norms are drawn around 0 (the model multiplies by ``1 + w``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from raymoe.models.tiny_archs import _common
from raymoe.models.tiny_init import LM_HEAD_GAIN, NORM_NOISE, OUT_PROJ_GAIN, ROUTER_GAIN, linear, norm

CONV_KERNEL = 4


def layer_types(num_layers: int) -> list[str]:
    """Every third layer full attention, the others linear attention."""
    return ["full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(num_layers)]


def _linear_dims(s) -> dict[str, int]:
    return {"linear_num_key_heads": s.num_kv_heads, "linear_num_value_heads": s.num_heads,
            "linear_key_head_dim": s.head_dim // 2, "linear_value_head_dim": s.head_dim // 2,
            "linear_conv_kernel_dim": CONV_KERNEL}


def qwen3_5_config(s) -> dict[str, Any]:
    """config.json of a tiny Qwen3.5-MoE text model."""
    cfg = _common(s, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")
    cfg.update(_linear_dims(s))
    cfg.update({"num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim, "num_experts": s.num_experts,
                "num_experts_per_tok": s.num_experts_per_tok, "moe_intermediate_size": s.moe_intermediate_size,
                "shared_expert_intermediate_size": s.moe_intermediate_size, "layer_types": layer_types(s.num_layers),
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                "output_router_logits": False, "router_aux_loss_coef": 0.001})
    if s.mtp_layers:
        cfg["mtp_num_hidden_layers"] = s.mtp_layers
    return cfg


def _centered(gen: torch.Generator, n: int) -> torch.Tensor:
    """A zero-centered norm weight: small around 0."""
    return NORM_NOISE * torch.randn(n, generator=gen)


def _linear_attn(s, gen: torch.Generator, a: str) -> dict[str, torch.Tensor]:
    d = _linear_dims(s)
    kd = d["linear_num_key_heads"] * d["linear_key_head_dim"]
    vd = d["linear_num_value_heads"] * d["linear_value_head_dim"]
    hv, h = d["linear_num_value_heads"], s.hidden_size
    return {a + "in_proj_qkv.weight": linear(gen, 2 * kd + vd, h), a + "in_proj_z.weight": linear(gen, vd, h),
            a + "in_proj_b.weight": linear(gen, hv, h), a + "in_proj_a.weight": linear(gen, hv, h),
            a + "conv1d.weight": 0.5 * torch.randn(2 * kd + vd, 1, CONV_KERNEL, generator=gen),
            a + "dt_bias": torch.randn(hv, generator=gen) * 0.5,
            a + "A_log": torch.log(torch.empty(hv).uniform_(1.0, 8.0, generator=gen)),
            a + "norm.weight": norm(gen, d["linear_value_head_dim"]),
            a + "out_proj.weight": linear(gen, h, vd, OUT_PROJ_GAIN)}


def _full_attn(s, gen: torch.Generator, a: str) -> dict[str, torch.Tensor]:
    h, d = s.hidden_size, s.head_dim
    return {a + "q_proj.weight": linear(gen, 2 * s.num_heads * d, h),
            a + "k_proj.weight": linear(gen, s.num_kv_heads * d, h),
            a + "v_proj.weight": linear(gen, s.num_kv_heads * d, h),
            a + "o_proj.weight": linear(gen, h, s.num_heads * d, OUT_PROJ_GAIN),
            a + "q_norm.weight": _centered(gen, d), a + "k_norm.weight": _centered(gen, d)}


def qwen3_5_weights(s, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """Weights in build steps: embeddings, one dict per layer, final norm + LM head."""
    h = s.hidden_size
    yield {"model.embed_tokens.weight": torch.randn(s.vocab_size, h, generator=gen)}
    for layer, kind in enumerate(layer_types(s.num_layers)):
        yield _decoder_layer(s, gen, f"model.layers.{layer}.", kind)
    last = {"model.norm.weight": _centered(gen, h)}
    if not s.tie_word_embeddings:
        last["lm_head.weight"] = linear(gen, s.vocab_size, h, LM_HEAD_GAIN)
    yield last
    if s.mtp_layers:  # drawn last: the tensors above do not depend on it
        t = {"mtp.fc.weight": linear(gen, h, 2 * h), "mtp.pre_fc_norm_embedding.weight": _centered(gen, h),
             "mtp.pre_fc_norm_hidden.weight": _centered(gen, h), "mtp.norm.weight": _centered(gen, h)}
        t.update(_decoder_layer(s, gen, "mtp.layers.0.", "full_attention"))
        yield t


def _decoder_layer(s, gen: torch.Generator, p: str, kind: str) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors under prefix ``p``: norms, its token mixer, the MoE with a gated shared expert."""
    h, i = s.hidden_size, s.moe_intermediate_size
    t = {p + "input_layernorm.weight": _centered(gen, h), p + "post_attention_layernorm.weight": _centered(gen, h)}
    t.update(_linear_attn(s, gen, p + "linear_attn.") if kind == "linear_attention"
             else _full_attn(s, gen, p + "self_attn."))
    m = p + "mlp."
    t[m + "gate.weight"] = linear(gen, s.num_experts, h, ROUTER_GAIN)
    for e in range(s.num_experts):
        t[f"{m}experts.{e}.gate_proj.weight"] = linear(gen, i, h)
        t[f"{m}experts.{e}.up_proj.weight"] = linear(gen, i, h)
        t[f"{m}experts.{e}.down_proj.weight"] = linear(gen, h, i, OUT_PROJ_GAIN)
    t[m + "shared_expert.gate_proj.weight"] = linear(gen, i, h)
    t[m + "shared_expert.up_proj.weight"] = linear(gen, i, h)
    t[m + "shared_expert.down_proj.weight"] = linear(gen, h, i, OUT_PROJ_GAIN)
    t[m + "shared_expert_gate.weight"] = linear(gen, 1, h)
    return t


def qwen3_next_config(s) -> dict[str, Any]:
    """config.json of a tiny Qwen3-Next (``Qwen3NextForCausalLM``): the Qwen3.5 sizes, every layer MoE."""
    cfg = qwen3_5_config(s)
    cfg.update({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []})
    if s.mtp_layers:  # Qwen3-Next's name for it
        cfg["num_nextn_predict_layers"] = cfg.pop("mtp_num_hidden_layers")
    return cfg


def qwen3_next_weights(s, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """The Qwen3.5 tensors of the same seed with each Gated DeltaNet layer's projections fused as Qwen3-Next stores
    them: per key head its query, key, values and output gates (``in_proj_qkvz``), then its b and a rows
    (``in_proj_ba``; ``raymoe.models.qwen3_next`` regroups them back on load)."""
    d = _linear_dims(s)
    hk, hv = d["linear_num_key_heads"], d["linear_num_value_heads"]
    dk, dv, r = d["linear_key_head_dim"], d["linear_value_head_dim"], hv // hk
    for t in qwen3_5_weights(s, gen):
        for name in [n for n in t if n.endswith("linear_attn.in_proj_qkv.weight")]:
            a = name[:-len("in_proj_qkv.weight")]
            q, k, v = t.pop(name).split((hk * dk, hk * dk, hv * dv))
            z = t.pop(a + "in_proj_z.weight")
            h = q.shape[1]
            heads = [x.reshape(hk, -1, h) for x in (q, k, v, z)]
            t[a + "in_proj_qkvz.weight"] = torch.cat(heads, dim=1).reshape(-1, h)
            b, aa = (t.pop(a + f"in_proj_{p}.weight").reshape(hk, r, h) for p in "ba")
            t[a + "in_proj_ba.weight"] = torch.cat([b, aa], dim=1).reshape(-1, h)
        yield t
