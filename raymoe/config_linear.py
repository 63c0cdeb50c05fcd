"""Frozen sub-records of ``ModelConfig`` for hybrid linear-attention models (Qwen3.5-MoE: Gated DeltaNet layers
beside gated full-attention layers) and their config normalization.

Qwen3.5-MoE (Qwen team; transformers ``Qwen3_5MoeTextConfig``, ``model_type`` ``qwen3_5_moe_text``) interleaves
``linear_attention`` layers (Gated DeltaNet, Yang et al. 2024, arXiv:2412.06464: a short causal depthwise conv over
the q/k/v projections, then the gated delta rule over a per-request recurrent state) with ``full_attention`` layers
whose output is gated per channel by ``sigmoid`` of a second half of the query projection; every layer has a MoE
block with one shared expert scaled by ``sigmoid(x @ shared_expert_gate)``; its RMSNorms are zero-centered
(``x * (1 + w)``) and its rotary embedding covers ``partial_rotary_factor`` of each head.

This module imports nothing from raymoe, so both ``raymoe.config`` and ``raymoe.layers`` may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HYBRID_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
"""``model_type`` values normalized by :func:`qwen3_5_fields` (``qwen3_5_moe``: the released image-text checkpoints,
whose ``text_config`` holds the language model's keys: :func:`text_config_of`; ``qwen3_next``: Qwen3-Next, the same
layer types with head-grouped fused projections and optional dense layers)."""


def text_config_of(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys of a ``qwen3_5_moe`` config (its ``text_config``, with the top level's
    ``model_type``, ``tie_word_embeddings`` and ``eos_token_id`` where the top level has them); other configs as
    they are. The vision tower is not served."""
    text = d.get("text_config")
    if d.get("model_type") != "qwen3_5_moe" or not isinstance(text, dict):
        return d
    top = {key: d[key] for key in ("tie_word_embeddings", "eos_token_id", "quantization_config") if key in d}
    return {**text, **top, "model_type": "qwen3_5_moe"}


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Sizes of the Gated DeltaNet layers (elements).

    Attributes:
        num_key_heads, num_value_heads: query/key heads and value heads (each key head serves
            ``num_value_heads / num_key_heads`` consecutive value heads).
        key_head_dim, value_head_dim: per-head sizes. conv_kernel: the causal conv's width (the conv state keeps
            ``conv_kernel - 1`` inputs per channel).
    Raises:
        ValueError: a size below 1, a conv kernel below 2, or value heads that are not a multiple of key heads.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear attention {name} must be >= 1")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def key_dim(self) -> int:
        """Channels of the query (and of the key) projection."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Channels of the value projection (and of the output gate ``z``)."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: query, key, then value."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class HybridArch:
    """What Qwen3.5-MoE adds to a GQA MoE decoder (module docstring).

    Attributes:
        linear: the Gated DeltaNet sizes. shared_expert_intermediate_size: the shared expert's width (0: none).
    """

    linear: LinearAttentionConfig
    shared_expert_intermediate_size: int

    def __post_init__(self) -> None:
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must be >= 0")


def qwen3_5_fields(d: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3.5-MoE text (or Qwen3-Next) config dict ``d``: ``layer_types`` (default: a
    full-attention layer every ``full_attention_interval`` layers, else linear), the linear-attention sizes, the
    shared expert, and which layers are MoE: every layer for Qwen3.5 (its router always renormalizes the top-k
    weights: the caller sets that), ``mlp_only_layers`` / ``decoder_sparse_step`` for Qwen3-Next.

    Raises:
        KeyError: a linear-attention size is missing. ValueError: bad sizes or layer types.
    """
    n = int(d["num_hidden_layers"])
    interval = int(d.get("full_attention_interval", 4))
    types = d.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                     for i in range(n)]
    linear = LinearAttentionConfig(int(d["linear_num_key_heads"]), int(d["linear_num_value_heads"]),
                                   int(d["linear_key_head_dim"]), int(d["linear_value_head_dim"]),
                                   int(d.get("linear_conv_kernel_dim", 4)))
    return {"layer_types": tuple(str(t) for t in types),
            "hybrid": HybridArch(linear, int(d.get("shared_expert_intermediate_size") or 0)),
            "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ())
            if d.get("model_type") == "qwen3_next" else ()}
