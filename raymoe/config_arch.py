"""Frozen sub-records of ``ModelConfig`` for architecture variants (multi-head latent attention, MoE routing) and the
DeepSeek-specific part of config normalization.

``ModelConfig.from_dict`` fills them from a Hugging Face config (it is the one entry point that knows each
family's key names; :func:`deepseek_fields` is its DeepSeek branch); layers read only these normalized fields.
This module imports nothing from raymoe, so both ``raymoe.config`` and ``raymoe.layers`` may import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited")
GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention sizes (DeepSeek-V2 paper, Sec. 2.1; arXiv:2405.04434). Sizes in elements.

    Attributes:
        q_lora_rank: rank of the query down-projection; ``None``: queries come from one full ``q_proj``.
        kv_lora_rank: size of the compressed key/value latent ``c_KV`` that the cache stores.
        qk_nope_head_dim: per-head query/key size without rotary position.
        qk_rope_head_dim: per-head rotary part (the decoupled key is shared by all heads).
        v_head_dim: per-head value size.
        rope_interleave: rotary pairs are adjacent channels ``(x0, x1), (x2, x3) ...`` (DeepSeek's layout; V2 always,
            V3 unless ``rope_interleave`` is false) instead of halves.
        softmax_scale: attention scale, ``qk_head_dim ** -0.5`` times YaRN's ``mscale ** 2`` when scaled.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    def __post_init__(self) -> None:
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError("q_lora_rank must be >= 1 or None")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (rotary pairs)")
        if not self.softmax_scale > 0:
            raise ValueError("softmax_scale must be > 0")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key size: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values the MLA cache keeps per token per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class RouterConfig:
    """How a MoE gate turns router logits into top-k experts and weights.

    Attributes:
        scoring_func: ``"softmax"`` (Qwen3-MoE, Mixtral, DeepSeek-V2) or ``"sigmoid"`` (DeepSeek-V3).
        topk_method: ``"greedy"`` (top-k over all experts) or ``"group_limited"`` (experts in ``n_group`` equal
            groups; only the ``topk_group`` best groups are eligible: DeepSeek-V2 Sec. 2.2 device-limited routing,
            DeepSeek-V3 node-limited routing).
        n_group, topk_group: group count and eligible groups (1, 1 when greedy).
        group_score: a group's score: its best expert (``"max"``, V2) or the sum of its best two (``"top2_sum"``, V3).
        use_correction_bias: add ``e_score_correction_bias`` to the scores for choosing only (V3 aux-loss-free
            balancing); the weights stay the uncorrected scores.
        norm_topk_prob: renormalize the chosen weights to sum to 1.
        routed_scaling_factor: multiply the final weights (DeepSeek; 1.0 elsewhere).
        masked_fill: score given to experts of ineligible groups (V2 masks with 0.0, V3 with -inf).
    """

    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    use_correction_bias: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    masked_fill: float = 0.0

    @property
    def is_softmax_greedy(self) -> bool:
        """Softmax scores, greedy top-k over all experts, no correction bias (Qwen3-MoE, Mixtral, DeepSeek-V2
        ``greedy``): the variant the fused CPU kernels route."""
        return self.scoring_func == "softmax" and self.topk_method == "greedy" and not self.use_correction_bias

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need n_group >= 1 and 1 <= topk_group <= n_group, got {self.n_group}, {self.topk_group}")
        if self.routed_scaling_factor <= 0:
            raise ValueError("routed_scaling_factor must be > 0")


LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class GptOssArch:
    """What gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b model card") adds to a GQA MoE decoder, beside the
    per-layer attention windows of ``ModelConfig``: a learned attention sink per query head (``self_attn.sinks``),
    biases on the router and the experts, and the clamped SwiGLU of its experts:
    ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, ``out = (up + 1) * gate * sigmoid(alpha * gate)``
    with gate and up interleaved in ``gate_up_proj`` (even / odd columns).

    Attributes:
        swiglu_alpha: the sigmoid's slope (1.702 in the released models).
        swiglu_limit: the clamp bound (7.0 in the released models); > 0.
    """

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.swiglu_limit}")
        if not self.swiglu_alpha > 0:
            raise ValueError(f"swiglu_alpha must be > 0, got {self.swiglu_alpha}")


def gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a gpt-oss config dict ``d``: the experts are ``intermediate_size`` wide, top-k
    weights are the softmax over the chosen logits (equal to the renormalized softmax), every layer is MoE, keys a
    config may leave out take transformers' ``GptOssConfig`` defaults (sliding layers on even indices, a window of
    128, attention biases on, SwiGLU alpha 1.702 and limit 7) and the quantization, if any, must be MXFP4
    (``quant_method: mxfp4``; its blocks and scales are dequantized at load).

    Raises:
        ValueError: a quantization method other than MXFP4.
    """
    quant = d.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise ValueError(f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported for "
                         "gpt_oss (only 'mxfp4')")
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return {"router": RouterConfig(norm_topk_prob=True),
            "gpt_oss": GptOssArch(float(d.get("swiglu_alpha", 1.702)), float(d.get("swiglu_limit", 7.0))),
            "moe_intermediate_size": int(d["intermediate_size"]), "layer_types": tuple(str(t) for t in types),
            "sliding_window": None if d.get("sliding_window", 128) is None else int(d.get("sliding_window", 128)),
            "attention_bias": bool(d.get("attention_bias", True))}


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN attention-temperature factor ``0.1 * mscale * ln(scale) + 1`` (Peng et al. 2023, arXiv:2309.00071,
    as parameterized by DeepSeek-V2); 1 when ``scale <= 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_fields(d: dict[str, Any], rope: dict[str, Any], heads: int) -> dict[str, Any]:
    """``ModelConfig`` fields of a DeepSeek-V2/V3 config dict ``d`` (``rope``: its normalized rope parameters;
    ``heads``: attention heads). Called by ``ModelConfig.from_dict`` only. Quirks handled: MLA sizes and softmax
    scale (YaRN ``mscale_all_dim`` squared), rotary size as ``head_dim``, one latent "kv head" (kv head counts in
    these configs are meaningless), dense layers from ``first_k_dense_replace``/``moe_layer_freq``, and the routing
    variant (V2: softmax, ``topk_method`` greedy or ``group_limited_greedy``; V3: sigmoid, group-limited with
    top-2-sum group scores and a correction bias).

    Raises:
        KeyError: an MLA size is missing. ValueError: an unsupported ``topk_method`` or invalid sizes.
    """
    v3 = d.get("model_type") == "deepseek_v3"
    nope, rope_dim = int(d["qk_nope_head_dim"]), int(d["qk_rope_head_dim"])
    scale = (nope + rope_dim) ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    q_lora = d.get("q_lora_rank")
    mla = MLAConfig(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(d["kv_lora_rank"]),
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=int(d["v_head_dim"]),
                    rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True, softmax_scale=scale)
    n_group, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    if v3:
        router = RouterConfig(scoring_func="sigmoid", topk_method="group_limited", n_group=n_group,
                              topk_group=topk_group, group_score="top2_sum", use_correction_bias=True,
                              norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                              routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                              masked_fill=float("-inf"))
    else:
        method = d.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported for deepseek_v2")
        grouped = method == "group_limited_greedy"
        router = RouterConfig(scoring_func="softmax", topk_method="group_limited" if grouped else "greedy",
                              n_group=n_group if grouped else 1, topk_group=topk_group if grouped else 1,
                              norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                              routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)))
    first_dense, freq = int(d.get("first_k_dense_replace") or 0), int(d.get("moe_layer_freq") or 1)
    dense = [i for i in range(int(d["num_hidden_layers"])) if i < first_dense or i % freq]
    return {"mla": mla, "router": router, "n_shared_experts": int(d.get("n_shared_experts") or 0),
            "head_dim": rope_dim, "num_key_value_heads": heads, "mlp_only_layers": dense}
