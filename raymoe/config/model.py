"""The model's architecture: ``ModelConfig.from_hf`` normalizes Hugging Face ``config.json`` quirks (attribute
aliases, ``rope_scaling`` vs ``rope_parameters``, missing ``head_dim``) in one place; everything else reads only the
normalized fields."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raymoe.config_arch import LAYER_TYPES, GptOssArch, MLAConfig, RouterConfig, deepseek_fields, gpt_oss_fields
from raymoe.config_linear import HYBRID_MODEL_TYPES, HybridArch, qwen3_5_fields, text_config_of
from raymoe.config_quant import Fp8Config, parse_quantization_config
from raymoe.errors import CheckpointError


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only MoE model, normalized from a Hugging Face ``config.json``.

    Sizes are in elements; ``head_dim`` is per attention head (the rotary part for MLA, as transformers sets it).
    ``rope_parameters`` always has ``rope_type`` and ``rope_theta``. ``hf_config`` keeps the raw dict (used for RoPE
    scaling variants). ``mla`` is set for multi-head latent attention (DeepSeek-V2/V3); ``router`` says how experts
    are chosen; ``n_shared_experts`` shared experts of ``moe_intermediate_size`` each run on every token of a MoE
    layer. Dense layers are listed in ``mlp_only_layers`` whatever the family's own rule (normalized here).
    ``quantization``: the checkpoint's FP8 weight format (``raymoe.config_quant``), None for unquantized weights.
    ``layer_types`` (empty: every layer ``full_attention``) and ``sliding_window`` (tokens: a query attends to the
    last ``sliding_window`` positions, itself included) give each layer's attention span; ``gpt_oss`` is set for
    gpt-oss (sinks, biases, clamped SwiGLU). ``hybrid`` is set for Qwen3.5-MoE (``raymoe.config_linear``: Gated
    DeltaNet ``linear_attention`` layers, gated full attention, a gated shared expert, zero-centered norms).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    hf_config: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    mla: MLAConfig | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    n_shared_experts: int = 0
    quantization: Fp8Config | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    gpt_oss: GptOssArch | None = None
    hybrid: HybridArch | None = None

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES) - ({"linear_attention"} if self.hybrid else set()))
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported (supported: {list(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("sliding_attention layers need sliding_window >= 1")
        if self.n_shared_experts < 0:
            raise ValueError("n_shared_experts must be >= 0")
        if self.router.topk_method == "group_limited" and self.num_experts % self.router.n_group:
            raise ValueError("num_experts must be a multiple of n_group")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")

    def attention_window(self, layer_id: int) -> int | None:
        """Tokens layer ``layer_id`` attends to (the query's own position and the ones before it), or None for
        every cached position."""
        if self.layer_types and self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window
        return None

    def is_linear_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` is a linear-attention (Gated DeltaNet) layer."""
        return bool(self.layer_types) and self.layer_types[layer_id] == "linear_attention"

    @property
    def num_linear_layers(self) -> int:
        """Linear-attention layers (each keeps a recurrent state per request, no KV)."""
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def num_nextn_predict_layers(self) -> int:
        """Multi-token-prediction layers the checkpoint carries (DeepSeek-V3's and Qwen3-Next's
        ``num_nextn_predict_layers``, Qwen3.5's ``mtp_num_hidden_layers``; 0 for the other families)."""
        return int(self.hf_config.get("num_nextn_predict_layers", 0) or self.hf_config.get("mtp_num_hidden_layers", 0)
                   or 0)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` has a sparse MoE block (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Normalize a Hugging Face config dict (Qwen3-MoE, Mixtral, DeepSeek-V2/V3, gpt-oss key names).

        Raises:
            ValueError: an unsupported ``quantization_config`` (its method or field named) or a bad size.
            KeyError: a required key is missing.
        """
        d = text_config_of(d)  # an image-text Qwen3.5-MoE: its language model
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        rope = dict(_first(d, "rope_parameters", "rope_scaling", default={}) or {})
        rope.setdefault("rope_theta", float(_first(d, "rope_theta", default=rope.get("rope_theta", 10000.0))))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        model_type = str(d.get("model_type", ""))
        # Qwen3-MoE: softmax top-k, renormalized iff norm_topk_prob; Mixtral always renormalizes.
        extra: dict[str, Any] = {"router": RouterConfig(
            norm_topk_prob=model_type == "mixtral" or bool(d.get("norm_topk_prob", False)))}
        if model_type in ("deepseek_v2", "deepseek_v3"):
            extra = deepseek_fields(d, rope, heads)
        elif model_type == "gpt_oss":
            extra = gpt_oss_fields(d)
        elif model_type in HYBRID_MODEL_TYPES:
            extra = {**qwen3_5_fields(d), "router": RouterConfig(
                norm_topk_prob=model_type != "qwen3_next" or bool(d.get("norm_topk_prob", True)))}
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(extra.pop("num_key_value_heads", _first(d, "num_key_value_heads", default=heads))),
            head_dim=int(extra.pop("head_dim", _first(d, "head_dim", default=hidden // heads))),
            intermediate_size=int(d.get("intermediate_size", 0)),
            moe_intermediate_size=int(extra.pop("moe_intermediate_size", None) or _first(
                d, "moe_intermediate_size", default=d.get("intermediate_size", 0))),
            num_experts=int(_first(d, "num_experts", "num_local_experts", "n_routed_experts", default=0)),
            num_experts_per_tok=int(_first(d, "num_experts_per_tok", default=1)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(_first(d, "decoder_sparse_step", default=1)),
            mlp_only_layers=tuple(int(x) for x in extra.pop("mlp_only_layers", d.get("mlp_only_layers") or ())),
            rms_norm_eps=float(_first(d, "rms_norm_eps", default=1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(_first(d, "max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(extra.pop("attention_bias", d.get("attention_bias", False))),
            hidden_act=str(d.get("hidden_act", "silu")),
            eos_token_ids=eos_ids,
            hf_config=dict(d),
            # gpt-oss reads its own (MXFP4 experts, ``gpt_oss_fields``); every other family's is FP8 or refused
            quantization=None if model_type == "gpt_oss" else parse_quantization_config(d.get("quantization_config")),
            **extra,
        )

    @classmethod
    def from_hf(cls, model_path: str | Path) -> "ModelConfig":
        """Read ``model_path/config.json``.

        Raises:
            CheckpointError: the folder or its config.json is missing or unreadable.
        """
        path = Path(model_path)
        cfg = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(str(path), "model folder does not exist")
        if not cfg.is_file():
            raise CheckpointError(str(cfg), "config.json is missing")
        try:
            d = json.loads(cfg.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(str(cfg), f"cannot parse config.json: {e}") from e
        gen = path / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text())
                if g.get("eos_token_id") is not None:
                    d = {**d, "eos_token_id": g["eos_token_id"]}
            except (OSError, json.JSONDecodeError):
                pass
        try:
            return cls.from_dict(d)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(str(cfg), f"unsupported or incomplete config: {e}") from e
