"""Qwen3-MoE (Qwen team, 2025) on raymoe's parallel layers.

Architecture: token embedding -> N decoder layers (pre-norm GQA attention with per-head q/k RMSNorm and RoPE;
pre-norm sparse MoE block, or a dense SwiGLU MLP for ``mlp_only_layers`` / ``decoder_sparse_step``) -> RMSNorm
-> LM head. Each decoder layer's forward is an op list (DESIGN section 4) run by ``raymoe.overlap``.
Checkpoint names are Hugging Face's on-disk names (per-expert tensors).
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.eplb.location import ExpertLocation
from raymoe.layers.fp8 import module_quant
from raymoe.layers.linear import QKVParallelLinear, RowParallelLinear
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, MoeCausalLM, build_mlp, load_norm
from raymoe.overlap.operations import ForwardState, OpRole, stage_op
from raymoe.platform.interface import Platform


class Qwen3MoeAttention(nn.Module):
    """GQA self-attention with q/k RMSNorm (``qk_norm=False``: without, as Mixtral). Ops: ``op_prepare`` (qkv,
    norms, RoPE), ``op_core`` (attention, o_proj)."""

    def __init__(self, config: ModelConfig, layer_id: int, groups: ParallelGroups, rotary: RotaryEmbedding,
                 dtype: torch.dtype, ops: Platform, qk_norm: bool = True):
        super().__init__()
        self.layer_id = layer_id
        self.ops = ops
        self.head_dim = config.head_dim
        prefix = f"model.layers.{layer_id}.self_attn"
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, groups, dtype, ops, bias=config.attention_bias,
                                          quant=module_quant(config.quantization, f"{prefix}.q_proj"))
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, groups,
                                        dtype, ops, bias=config.attention_bias,
                                        quant=module_quant(config.quantization, f"{prefix}.o_proj"))
        self.qk_norm = qk_norm
        self.norm_eps = config.rms_norm_eps
        if qk_norm:
            # [Hq + Hkv, D]: the checkpoint's q_norm weight on every query head, then k_norm's on every kv head
            self.register_buffer("qk_norm_weight", torch.ones(self.num_heads + self.num_kv_heads, config.head_dim,
                                                              dtype=dtype), persistent=False)
        self.rotary = rotary

    @stage_op(OpRole.ATTN_PREPARE)
    def op_prepare(self, state: ForwardState) -> None:
        """qkv projection, q/k RMSNorm and RoPE. Queries and keys stay side by side ([T, Hq + Hkv, D], as the
        projection lays them out), so both are normed (per-head weights) and rotated by one platform operation
        (``Platform.qk_norm_rope``; in place in the projection's output on a CPU rank)."""
        x = state.hidden_states
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[:, :(hq + hkv) * d].reshape(t, hq + hkv, d)
        qk = self.ops.qk_norm_rope(qk, self.qk_norm_weight if self.qk_norm else None, self.norm_eps, self.rotary,
                                   state.forward_batch.positions)
        state.q, state.k = qk[:, :hq], qk[:, hq:]
        state.v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)

    @stage_op(OpRole.ATTN_CORE)
    def op_core(self, state: ForwardState) -> None:
        fb = state.forward_batch
        o = fb.attn_backend.forward(state.q, state.k, state.v, self.layer_id, fb)
        state.hidden_states = self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))  # T may be 0 (IDLE)
        state.q = state.k = state.v = None

    def load(self, reader, prefix: str) -> None:
        self.qkv_proj.load(reader, [f"{prefix}.{p}_proj.weight" for p in ("q", "k", "v")])
        self.o_proj.load(reader, f"{prefix}.o_proj.weight")
        if self.qk_norm:
            load_norm(self.qk_norm_weight[:self.num_heads], reader, f"{prefix}.q_norm.weight")
            load_norm(self.qk_norm_weight[self.num_heads:], reader, f"{prefix}.k_norm.weight")


class Qwen3MoeForCausalLM(MoeCausalLM):
    """The whole model on one rank.

    Args:
        config: normalized model config.
        groups: the rank's process groups (TP for attention/dense, EP for experts).
        dtype: parameter and activation dtype.
        ops: the rank's platform.
        a2a_backend: MoE all-to-all backend name.
        enable_sbo: single-batch overlap inside MoE layers (``raymoe.overlap.sbo``; same on every rank).
        expert_location: the EP group's physical expert slots (``raymoe.eplb``; None: one slot per expert).
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 a2a_backend: str = "torch", enable_sbo: bool = False,
                 expert_location: ExpertLocation | None = None):
        super().__init__(config, groups, dtype, ops, enable_sbo)
        rotary = RotaryEmbedding(config, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(i, Qwen3MoeAttention(config, i, groups, rotary, dtype, ops),
                         build_mlp(config, i, groups, dtype, ops, a2a_backend, expert_location=expert_location),
                         config.hidden_size,
                         config.rms_norm_eps, dtype, ops)
            for i in range(config.num_hidden_layers))
        self.num_local_heads = self.layers[0].self_attn.num_heads
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads
