"""DeepSeek-V2 (arXiv:2405.04434) and DeepSeek-V3 (arXiv:2412.19437) on raymoe's parallel layers.

Architecture: embedding -> N pre-norm decoder layers (multi-head latent attention, ``raymoe.layers.mla``; then a
dense SwiGLU MLP for the first ``first_k_dense_replace`` layers and layers off ``moe_layer_freq``, else a MoE
block with routed experts sharded over the EP group plus always-on shared experts) -> RMSNorm -> LM head.
Routing (``raymoe.layers.router``): V2 softmax with greedy or group-limited top-k; V3 sigmoid with a correction
bias and group-limited top-k; both scale by ``routed_scaling_factor``. RoPE covers only the decoupled
``qk_rope_head_dim`` channels, in interleaved pairs; YaRN scaling (cos/sin attention factor and the softmax
``mscale**2``) follows the reference implementation (``ModelConfig.from_dict`` and ``raymoe.layers.rotary``).

The KV cache holds the compressed latent and the rotary key per token (``MLATokenToKVPool``); decode runs the
weight-absorbed form. Checkpoint names are Hugging Face's (per-expert ``mlp.experts.E.*_proj``,
``mlp.shared_experts.*``, ``mlp.gate.e_score_correction_bias`` for V3). DeepSeek-V3's multi-token-prediction
layer is loaded only as the draft model of speculative decoding (``enable_mtp``, ``raymoe.models.deepseek_mtp``).
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.eplb.location import ExpertLocation
from raymoe.layers.mla import MLAAttention
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, MoeCausalLM, build_mlp
from raymoe.platform.interface import Platform


class DeepseekV2ForCausalLM(MoeCausalLM):
    """The whole DeepSeek-V2/V3 model on one rank (see the module docstring).

    Args:
        config: normalized config with ``config.mla`` set. groups: the rank's process groups.
        dtype: parameter dtype. ops: the rank's platform. a2a_backend: MoE all-to-all backend. enable_sbo:
        single-batch overlap. expert_location: the EP group's physical expert slots (``raymoe.eplb``; None: one
        slot per expert). enable_mtp: also build the checkpoint's first MTP layer as ``self.mtp`` (its KV in one
        more cache layer). It is kept out of ``modules()``: expert load balancing and graph hooks see the main
        model's layers only.
    Raises:
        ValueError: the config has no MLA section, or ``enable_mtp`` without an MTP layer in the config.
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 a2a_backend: str = "torch", enable_sbo: bool = False,
                 expert_location: ExpertLocation | None = None, enable_mtp: bool = False):
        super().__init__(config, groups, dtype, ops, enable_sbo)
        if config.mla is None:
            raise ValueError(f"{config.model_type}: config has no MLA section (kv_lora_rank ...)")
        rotary = RotaryEmbedding(config, dtype, interleaved=config.mla.rope_interleave)
        self.layers = nn.ModuleList(
            DecoderLayer(i, MLAAttention(config, i, groups, rotary, dtype, ops),
                         build_mlp(config, i, groups, dtype, ops, a2a_backend, expert_location=expert_location),
                         config.hidden_size, config.rms_norm_eps, dtype, ops)
            for i in range(config.num_hidden_layers))
        self.num_local_heads = self.layers[0].self_attn.num_heads
        self.__dict__["mtp"] = None  # a plain attribute: not a submodule (see the class docstring)
        if enable_mtp:
            if config.num_nextn_predict_layers < 1:
                raise ValueError(f"{config.model_type}: enable_mtp, but the config has no MTP layer")
            from raymoe.models.deepseek_mtp import DeepseekMTP

            self.__dict__["mtp"] = DeepseekMTP(config, groups, dtype, ops, a2a_backend, rotary, self.embed_tokens)
            self.extra_kv_layers = 1

    def create_kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        """The latent cache: ``kv_lora_rank + qk_rope_head_dim`` values per token per layer (one layer more for
        the MTP layer when it is built)."""
        from raymoe.kvcache.mla_pool import MLATokenToKVPool

        m = self.config.mla
        layers = self.config.num_hidden_layers + self.extra_kv_layers
        return MLATokenToKVPool(num_slots, layers, m.kv_lora_rank, m.qk_rope_head_dim, dtype, device)

    def load_weights(self, reader) -> None:
        """The main model's weights, then the MTP layer's when it is built."""
        super().load_weights(reader)
        if self.mtp is not None:
            self.mtp.load(reader)

    def create_attn_backend(self, name: str, req_to_token_pool, token_to_kv_pool):
        """The platform's MLA backend ``name`` over the latent cache.

        Raises:
            ValueError: ``name`` has no MLA implementation (``"torch_native"``, or ``"flashinfer_mla"`` on the
                model's head dims), e.g. ``"flash_attn"``.
        """
        return self.ops.mla_attention_backend(name, req_to_token_pool=req_to_token_pool,
                                              token_to_kv_pool=token_to_kv_pool, num_heads=self.num_local_heads,
                                              softmax_scale=self.config.mla.softmax_scale)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: the V2 model with V3's router (normalized by ``ModelConfig.from_dict``)."""
