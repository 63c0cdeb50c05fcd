"""Frozen sub-records of ``ModelConfig`` for architecture variants: multi-head latent attention and MoE routing.

``ModelConfig.from_dict`` fills them from a Hugging Face config (the one place that knows each family's key
names); layers read only these normalized fields. This module imports nothing from raymoe, so both
``raymoe.config`` and ``raymoe.layers`` may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
