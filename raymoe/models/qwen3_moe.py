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
from raymoe.errors import CheckpointError
from raymoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from raymoe.layers.linear import QKVParallelLinear, RowParallelLinear
from raymoe.layers.moe import DenseMLP, SparseMoeBlock
from raymoe.layers.norm import RMSNorm
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.overlap.forward import forward_layers
from raymoe.overlap.operations import ForwardState, OpRole, stage_op


def load_norm(norm: RMSNorm, reader, name: str) -> None:
    """Copy a replicated norm weight [hidden] from the checkpoint."""
    w = reader.get(name, dtype=norm.weight.dtype)
    if tuple(w.shape) != tuple(norm.weight.shape):
        raise CheckpointError(name, f"shape {tuple(w.shape)} does not match {tuple(norm.weight.shape)}")
    norm.weight.data.copy_(w)


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
        if qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.rotary = rotary

    def op_prepare(self, state: ForwardState) -> None:
        x = state.hidden_states
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        state.q, state.k = self.rotary(state.forward_batch.positions, q, k)
        state.v = v.reshape(t, self.num_kv_heads, self.head_dim)

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
            load_norm(self.q_norm, reader, f"{prefix}.q_norm.weight")
            load_norm(self.k_norm, reader, f"{prefix}.k_norm.weight")


class Qwen3MoeDecoderLayer(nn.Module):
    """Pre-norm decoder layer; ``state.hidden_states`` [T, H] in and out."""

    def __init__(self, config: ModelConfig, layer_id: int, groups: ParallelGroups, rotary: RotaryEmbedding,
                 dtype: torch.dtype, a2a_backend: str):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = Qwen3MoeAttention(config, layer_id, groups, rotary, dtype)
        self.is_moe = config.is_moe_layer(layer_id)
        if self.is_moe:
            self.mlp = SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                      config.moe_intermediate_size, config.norm_topk_prob, groups, dtype, a2a_backend)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, groups, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def op_comm_prepare_attn(self, state: ForwardState) -> None:
        state.residual = state.hidden_states
        state.hidden_states = self.input_layernorm(state.hidden_states)

    def op_comm_prepare_mlp(self, state: ForwardState) -> None:
        h = state.residual + state.hidden_states
        state.residual = h
        state.hidden_states = self.post_attention_layernorm(h)

    def op_dense_mlp(self, state: ForwardState) -> None:
        state.moe_output = self.mlp(state.hidden_states)

    def op_comm_postprocess_layer(self, state: ForwardState) -> None:
        state.hidden_states = state.residual + state.moe_output
        state.residual = state.moe_output = None

    def operations(self) -> list:
        """This layer's op list in execution order (no yields; strategies insert them)."""
        mlp_ops = self.mlp.operations() if self.is_moe else [self.op_dense_mlp]
        return [self.op_comm_prepare_attn, self.self_attn.op_prepare, self.self_attn.op_core,
                self.op_comm_prepare_mlp, *mlp_ops, self.op_comm_postprocess_layer]

    def load(self, reader, prefix: str) -> None:
        self.self_attn.load(reader, f"{prefix}.self_attn")
        self.mlp.load(reader, f"{prefix}.mlp")
        load_norm(self.input_layernorm, reader, f"{prefix}.input_layernorm.weight")
        load_norm(self.post_attention_layernorm, reader, f"{prefix}.post_attention_layernorm.weight")


class Qwen3MoeForCausalLM(nn.Module):
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
        super().__init__()
        self.config = config
        self.enable_sbo = enable_sbo
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, groups, dtype)
        rotary = RotaryEmbedding(config, dtype)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, i, groups, rotary, dtype, a2a_backend)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, groups, dtype)
        self.num_local_heads = self.layers[0].self_attn.num_heads
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads

    def layer_operations(self, layer_id: int) -> list:
        return self.layers[layer_id].operations()

    def create_kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        """Per-head K/V cache of this rank's kv heads (``TokenToKVPool``)."""
        from raymoe.models.decoder import gqa_kv_pool

        return gqa_kv_pool(self.config, self.num_local_kv_heads, num_slots, dtype, device)

    def create_attn_backend(self, name: str, req_to_token_pool, token_to_kv_pool):
        """The registry's attention backend ``name`` for this rank's heads."""
        from raymoe.models.decoder import gqa_attn_backend

        return gqa_attn_backend(name, req_to_token_pool, token_to_kv_pool, self.num_local_heads,
                                self.num_local_kv_heads, self.config.head_dim)

    def embed(self, forward_batch) -> ForwardState:
        """Start a forward: embeddings of ``forward_batch.input_ids`` [T] -> state with hidden_states [T, H]."""
        return ForwardState(hidden_states=self.embed_tokens(forward_batch.input_ids), residual=None,
                            forward_batch=forward_batch)

    def forward(self, forward_batch) -> torch.Tensor:
        """Run all layers eagerly (two-batch overlapped when ``forward_batch.tbo_children`` is set); returns
        final-normed hidden states [T, H] in token order."""
        state = forward_layers(self.layers, self.embed(forward_batch), self.enable_sbo)
        return self.norm(state.hidden_states)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: [N, H] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, reader) -> None:
        """Load this rank's shard from a ``CheckpointReader``.

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape (names the tensor).
        """
        self.embed_tokens.load(reader, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{i}")
        load_norm(self.norm, reader, "model.norm.weight")
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head.load(reader, head)
