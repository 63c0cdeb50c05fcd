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
from raymoe.layers.linear import QKVParallelLinear, RowParallelLinear
from raymoe.layers.norm import rms_norm
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, MoeCausalLM, build_mlp, load_norm
from raymoe.overlap.operations import ForwardState, OpRole, stage_op
from raymoe.platform.cpu.kernels import cpu_ops


class Qwen3MoeAttention(nn.Module):
    """GQA self-attention with q/k RMSNorm (``qk_norm=False``: without, as Mixtral). Ops: ``op_prepare`` (qkv,
    norms, RoPE), ``op_core`` (attention, o_proj)."""

    def __init__(self, config: ModelConfig, layer_id: int, groups: ParallelGroups, rotary: RotaryEmbedding,
                 dtype: torch.dtype, qk_norm: bool = True):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, groups, dtype, bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, groups,
                                        dtype, bias=config.attention_bias)
        self.qk_norm = qk_norm
        self.norm_eps = config.rms_norm_eps
        if qk_norm:
            # [Hq + Hkv, D]: the checkpoint's q_norm weight on every query head, then k_norm's on every kv head
            self.register_buffer("qk_norm_weight", torch.ones(self.num_heads + self.num_kv_heads, config.head_dim,
                                                              dtype=dtype), persistent=False)
        self.rotary = rotary

    def op_prepare(self, state: ForwardState) -> None:
        """qkv projection, q/k RMSNorm and RoPE. Queries and keys stay side by side ([T, Hq + Hkv, D], as the
        projection lays them out), so both are normed (per-head weights) and rotated by one set of operators; on
        a float32 CPU rank by one fused kernel, in place in the projection's output (``raymoe.platform.cpu.kernels.cpu_ops``)."""
        x = state.hidden_states
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[:, :(hq + hkv) * d].reshape(t, hq + hkv, d)
        positions = state.forward_batch.positions
        if not self.rotary.interleaved and cpu_ops.enabled_for(qkv, self.rotary.cos):
            norm_w = self.qk_norm_weight if self.qk_norm else None
            cpu_ops.qk_norm_rope_(qk, norm_w, self.norm_eps, self.rotary.cos, self.rotary.sin, positions)
        else:
            if self.qk_norm:
                qk = rms_norm(qk, self.qk_norm_weight, self.norm_eps)
            qk = self.rotary.rotate(positions, qk)
        state.q, state.k = qk[:, :hq], qk[:, hq:]
        state.v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)

    @stage_op(OpRole.ATTN_CORE)
    def op_core(self, state: ForwardState) -> None:
        fb = state.forward_batch
        o = fb.attn_backend.forward(state.q, state.k, state.v, self.layer_id, fb)
        state.hidden_states = self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))  # T may be 0 (IDLE)
        state.q = state.k = state.v = None

    def attn_block_weights(self) -> dict | None:
        """This attention as keyword arguments of :class:`~raymoe.platform.cpu.kernels.attn_block.AttnBlockPlan` (weights, head
        sizes, rotary tables, q/k norm), or None where the fused attention block does not apply (projection biases,
        interleaved rotary, tensor parallelism: the o projection's all-reduce sits between its ops)."""
        if (self.qkv_proj.bias is not None or self.o_proj.bias is not None or self.rotary.interleaved
                or self.o_proj.groups.tp_size != 1):
            return None
        return {"w_qkv": self.qkv_proj.weight, "w_o": self.o_proj.weight, "w_qkv_packed": self.qkv_proj.packed,
                "w_o_packed": self.o_proj.packed,
                "qk_norm_w": self.qk_norm_weight if self.qk_norm else None, "qk_eps": self.norm_eps,
                "cos": self.rotary.cos, "sin": self.rotary.sin, "heads": self.num_heads,
                "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "scale": self.head_dim ** -0.5}

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
        a2a_backend: MoE all-to-all backend name.
        enable_sbo: single-batch overlap inside MoE layers (``raymoe.overlap.sbo``; same on every rank).
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype = torch.float32,
                 a2a_backend: str = "torch", enable_sbo: bool = False):
        super().__init__(config, groups, dtype, enable_sbo)
        rotary = RotaryEmbedding(config, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(i, Qwen3MoeAttention(config, i, groups, rotary, dtype),
                         build_mlp(config, i, groups, dtype, a2a_backend), config.hidden_size,
                         config.rms_norm_eps, dtype)
            for i in range(config.num_hidden_layers))
        self.num_local_heads = self.layers[0].self_attn.num_heads
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads
