"""gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b model card") on raymoe's parallel layers.

Architecture: token embedding -> N pre-norm decoder layers -> RMSNorm -> LM head. Each layer: GQA attention with
biased q/k/v/o projections, neox RoPE (YaRN as configured: ``rope_parameters``, through transformers' inverse
frequencies and attention factor), a learned sink logit per query head, and a sliding window on the layers
``layer_types`` marks ``sliding_attention`` (``sliding_window`` tokens); then a MoE block whose every layer is
sparse: biased router, softmax over the top-k logits, biased clamped-SwiGLU experts
(``raymoe.layers.gpt_oss_moe``). Attention is the platform's backend given each layer's window and sinks
(``torch_native``: ``raymoe.attention.sink_window``; ``flash_attn``: the FA3 kernel's ``window_size`` / ``s_aux``).
With ``swa_kv_eviction`` the sliding layers' KV lives in per-request rings of ``sliding_window`` slots
(``raymoe.kvcache.swa_ring``, ``raymoe.attention.swa_ring``) and the token pool holds the full layers only.

Checkpoint names are transformers' (``self_attn.sinks``, ``mlp.router.{weight,bias}``, fused
``mlp.experts.{gate_up_proj,gate_up_proj_bias,down_proj,down_proj_bias}``); MXFP4 expert checkpoints are read
through :class:`~raymoe.models.mxfp4.Mxfp4Experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.attention.swa_ring import SwaRingAttnBackend
from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.errors import CheckpointError, InvalidRequestError
from raymoe.kvcache.pools import TokenToKVPool
from raymoe.kvcache.swa_ring import SlidingWindowRing
from raymoe.layers.gpt_oss_moe import GptOssMoeBlock
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, MoeCausalLM
from raymoe.models.mxfp4 import Mxfp4Experts
from raymoe.models.qwen3_moe import Qwen3MoeAttention
from raymoe.platform.interface import Platform


class GptOssAttention(Qwen3MoeAttention):
    """Qwen3-MoE's GQA attention without q/k norms, with projection biases and ``sinks`` [local query heads]
    (this rank's slice of the checkpoint's ``self_attn.sinks`` [num_attention_heads], float32)."""

    def __init__(self, config: ModelConfig, layer_id: int, groups: ParallelGroups, rotary: RotaryEmbedding,
                 dtype: torch.dtype, ops: Platform):
        super().__init__(config, layer_id, groups, rotary, dtype, ops, qk_norm=False)
        self.head_start = groups.tp_rank * self.num_heads
        self.register_buffer("sinks", torch.zeros(self.num_heads, dtype=torch.float32), persistent=False)

    def load(self, reader, prefix: str) -> None:
        super().load(reader, prefix)
        name = f"{prefix}.sinks"
        sinks = reader.get_slice(name, 0, self.head_start, self.head_start + self.num_heads, dtype=torch.float32)
        if tuple(sinks.shape) != (self.num_heads,):
            raise CheckpointError(name, f"unexpected shape {tuple(sinks.shape)}")
        self.sinks.copy_(sinks)


class GptOssForCausalLM(MoeCausalLM):
    """The whole gpt-oss model on one rank.

    Args:
        config: normalized model config (``config.gpt_oss`` set). groups: the rank's process groups. dtype:
            parameter dtype. ops: the rank's platform. a2a_backend: MoE all-to-all backend. enable_sbo: single-batch
            overlap inside MoE layers.

    Raises:
        ValueError: the config is not a gpt-oss one.
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 a2a_backend: str = "torch", enable_sbo: bool = False, expert_location=None,
                 swa_kv_eviction: bool = False, swa_ring_slack: int = 0):
        super().__init__(config, groups, dtype, ops, enable_sbo)
        if expert_location is not None:
            raise InvalidRequestError("ep_num_redundant_experts", "expert-parallel load balancing (redundant experts, "
                                      "expert load records) is not supported for gpt-oss models")
        if config.gpt_oss is None:
            raise ValueError(f"{config.model_type}: not a gpt-oss config")
        rotary = RotaryEmbedding(config, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(i, GptOssAttention(config, i, groups, rotary, dtype, ops),
                         GptOssMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                        config.moe_intermediate_size, groups, dtype, ops, a2a_backend,
                                        config.gpt_oss),
                         config.hidden_size, config.rms_norm_eps, dtype, ops)
            for i in range(config.num_hidden_layers))
        self.num_local_heads = self.layers[0].self_attn.num_heads
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.sliding = [config.attention_window(i) is not None for i in range(config.num_hidden_layers)]
        if swa_kv_eviction and not any(self.sliding):
            raise InvalidRequestError("swa_kv_eviction", "the model has no sliding_attention layers")
        self.swa_kv_eviction, self.swa_ring_slack, self.kv_dtype = swa_kv_eviction, swa_ring_slack, dtype
        self.swa_ring: SlidingWindowRing | None = None  # create_state_pool, with swa_kv_eviction

    def create_kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        """The token pool; with ``swa_kv_eviction`` of the full-attention layers only (the sliding layers keep
        per-row rings: :meth:`create_state_pool`)."""
        if not self.swa_kv_eviction:
            return super().create_kv_pool(num_slots, dtype, device)
        self.kv_dtype = dtype
        full = len(self.sliding) - sum(self.sliding)
        return TokenToKVPool(num_slots, full, self.num_local_kv_heads, self.config.head_dim, dtype, device)

    def create_state_pool(self, rows: int, device: torch.device | str) -> SlidingWindowRing | None:
        """With ``swa_kv_eviction``: the sliding layers' rings of ``sliding_window + swa_ring_slack`` slots per
        request row (``raymoe.kvcache.swa_ring``; the slack: speculative drafts per request); else None."""
        if not self.swa_kv_eviction:
            return None
        self.swa_ring = SlidingWindowRing(rows, self.config.sliding_window, sum(self.sliding), self.num_local_kv_heads,
                                          self.config.head_dim, self.kv_dtype, device, slack=self.swa_ring_slack)
        return self.swa_ring

    def create_attn_backend(self, name: str, req_to_token_pool, token_to_kv_pool):
        """The platform's backend ``name`` over the per-head K/V cache, given each layer's window and sinks
        (``torch_native``: :class:`~raymoe.attention.sink_window.SinkWindowAttnBackend`; ``flash_attn``: the
        kernel's ``window_size`` and ``s_aux``, FA3 only).

        Raises:
            ValueError: the backend cannot take sinks (``flash_attn`` on FA2) or ``name`` is unknown.
        """
        sinks = [layer.self_attn.sinks for layer in self.layers]
        heads = {"num_heads": self.num_local_heads, "num_kv_heads": self.num_local_kv_heads,
                 "head_dim": self.config.head_dim}
        if self.swa_ring is None:
            return self.ops.attention_backend(
                name, req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool, **heads,
                windows=[self.config.attention_window(i) for i in range(len(self.layers))], sinks=sinks)
        full = [s for s, sliding in zip(sinks, self.sliding, strict=True) if not sliding]
        inner = self.ops.attention_backend(name, req_to_token_pool=req_to_token_pool,
                                           token_to_kv_pool=token_to_kv_pool, **heads, windows=[None] * len(full),
                                           sinks=full)
        return SwaRingAttnBackend(inner, self.swa_ring, self.sliding, sinks, **heads)

    @torch.no_grad()
    def load_weights(self, reader) -> None:
        """Load this rank's shard; MXFP4 expert tensors are dequantized on the way (``Mxfp4Experts``).

        Raises:
            CheckpointError: a tensor is missing, has the wrong shape, or is quantized in a way not understood.
        """
        super().load_weights(Mxfp4Experts(reader))
