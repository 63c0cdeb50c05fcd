"""Multi-head latent attention (MLA; DeepSeek-V2 paper Sec. 2.1, arXiv:2405.04434), tensor-parallel by heads.

Per token: queries ``q = W_UQ RMSNorm(W_DQ x)`` (or ``W_Q x`` when ``q_lora_rank`` is None), split per head into
``q_nope`` and ``q_pe``; the compressed latent ``c_KV = RMSNorm(W_DKV x)`` and the decoupled rotary key ``k_pe``
(one head, shared). The cache keeps ``[c_KV | k_pe]`` only (``raymoe.kvcache.mla_pool``). Keys/values are
``W_UK c_KV`` / ``W_UV c_KV`` per head (``kv_b_proj`` holds ``[W_UK; W_UV]`` per head).

Extend and MIXED steps use the non-absorbed form (the backend expands cached rows with :meth:`MLAAttention.expand_kv`)
unless the step's backend takes absorbed queries for them too (``AttentionBackend.mla_absorbed_extend``: the paged
MLA GPU kernel); decode always uses the weight-absorbed form: ``q_nope W_UK`` is attended against ``c_KV`` directly
and ``W_UV`` is applied to the latent-space output. TP: ``q``/``kv_b``/``o`` projections are split by heads;
``q_a``/``kv_a`` and the cache are replicated. Ops: ``op_prepare`` (projections, norms, RoPE), ``op_core``
(attention, value up-projection, o_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raymoe.comm.groups import ParallelGroups, divide
from raymoe.config import ModelConfig
from raymoe.errors import CheckpointError
from raymoe.layers.fp8 import module_quant
from raymoe.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from raymoe.layers.norm import RMSNorm
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.overlap.operations import OpRole, stage_op
from raymoe.platform.interface import Platform

_LORA_NORM_EPS = 1e-6  # DeepSeek's q_a/kv_a RMSNorms use the default eps, not rms_norm_eps


def _absorbed(fb) -> bool:
    """Whether this step's queries are weight-absorbed: decode, a speculative verify step on a backend that runs
    it as decode rows (``verify_as_decode``), or a backend that takes them for extend too."""
    mode, backend = fb.forward_mode, fb.attn_backend
    return (mode.is_decode() or getattr(backend, "mla_absorbed_extend", False)
            or (mode.is_target_verify() and getattr(backend, "verify_as_decode", False)))


def _load_norm(norm: RMSNorm, reader, name: str) -> None:
    w = reader.get(name, dtype=norm.weight.dtype)
    if tuple(w.shape) != tuple(norm.weight.shape):
        raise CheckpointError(name, f"shape {tuple(w.shape)} does not match {tuple(norm.weight.shape)}")
    norm.weight.data.copy_(w)


class MLAAttention(nn.Module):
    """MLA self-attention of one layer. ``state.hidden_states`` [T, hidden] -> [T, hidden].

    Args:
        config: normalized model config with ``config.mla`` set.
        layer_id: index of the layer (its cache layer).
        groups: process groups (heads split over ``groups.tp_size``).
        rotary: rotary table over ``qk_rope_head_dim`` (interleaved pairs for DeepSeek).
        dtype: parameter dtype. ops: the rank's platform.
    Raises:
        ValueError: ``config.mla`` is None or the heads do not divide over TP.
    """

    def __init__(self, config: ModelConfig, layer_id: int, groups: ParallelGroups, rotary: RotaryEmbedding,
                 dtype: torch.dtype, ops: Platform):
        super().__init__()
        if config.mla is None:
            raise ValueError("MLAAttention needs config.mla")
        m = self.mla = config.mla
        self.layer_id = layer_id
        self.num_heads = divide(config.num_attention_heads, groups.tp_size, "num_attention_heads")
        heads, hidden, bias = config.num_attention_heads, config.hidden_size, config.attention_bias
        prefix = f"model.layers.{layer_id}.self_attn"

        def quant(module: str):
            return module_quant(config.quantization, f"{prefix}.{module}")

        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [heads * m.qk_head_dim], groups, dtype, ops,
                                               quant=quant("q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(hidden, m.q_lora_rank, dtype, ops, bias=bias, quant=quant("q_a_proj"))
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS, dtype, ops)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, [heads * m.qk_head_dim], groups, dtype, ops,
                                                 quant=quant("q_b_proj"))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, m.cache_dim, dtype, ops, bias=bias,
                                                   quant=quant("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LORA_NORM_EPS, dtype, ops)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, [heads * (m.qk_nope_head_dim + m.v_head_dim)],
                                              groups, dtype, ops, quant=quant("kv_b_proj"))
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, hidden, groups, dtype, ops, bias=bias,
                                        quant=quant("o_proj"))
        self.rotary = rotary

    def _w_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` [H_local, qk_nope, kv_lora_rank] and ``W_UV`` [H_local, v_head_dim, kv_lora_rank] in ``dtype``
        (views of the weight; of its dequantized values, made per call, where it is FP8)."""
        m = self.mla
        w = self.kv_b_proj.weight_values(dtype).view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def expand_kv(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Up-project cache rows [N, kv_lora_rank + qk_rope] into keys [N, H_local, qk_nope + qk_rope] (``k_pe``
        shared by all heads) and values [N, H_local, v_head_dim] (the non-absorbed form)."""
        m, n = self.mla, rows.shape[0]
        kv = F.linear(rows[:, : m.kv_lora_rank], self.kv_b_proj.weight_values(rows.dtype)).view(n, self.num_heads, -1)
        k_nope, values = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_pe = rows[:, None, m.kv_lora_rank:].expand(n, self.num_heads, m.qk_rope_head_dim)
        return torch.cat((k_nope, k_pe), dim=-1), values

    @stage_op(OpRole.ATTN_PREPARE)
    def op_prepare(self, state) -> None:
        """Queries and this step's cache rows: ``state.q`` ([T, H_local, qk_head_dim], or absorbed
        [T, H_local, kv_lora_rank + qk_rope] for decode), ``state.k`` = rows [T, kv_lora_rank + qk_rope],
        ``state.v`` = :meth:`expand_kv` (extend) or None (decode, or any step of a backend with
        ``mla_absorbed_extend``)."""
        m, x = self.mla, state.hidden_states
        t = x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotary(state.forward_batch.positions, q_pe, k_pe.unsqueeze(1))
        state.k = torch.cat((self.kv_a_layernorm(latent), k_pe.squeeze(1)), dim=-1)
        if _absorbed(state.forward_batch):
            w_uk, _ = self._w_kv(q_nope.dtype)
            state.q = torch.cat((torch.einsum("thd,hdl->thl", q_nope, w_uk), q_pe), dim=-1)
            state.v = None
        else:
            state.q = torch.cat((q_nope, q_pe), dim=-1)
            state.v = self.expand_kv

    @stage_op(OpRole.ATTN_CORE)
    def op_core(self, state) -> None:
        fb = state.forward_batch
        o = fb.attn_backend.forward(state.q, state.k, state.v, self.layer_id, fb)
        t = o.shape[0]
        if t and _absorbed(fb):
            _, w_uv = self._w_kv(o.dtype)
            o = torch.einsum("thl,hvl->thv", o, w_uv)                     # latent -> per-head values
        o = o.reshape(t, self.num_heads * self.mla.v_head_dim) if t else o.new_empty((0, self.o_proj.in_local))
        state.hidden_states = self.o_proj(o)
        state.q = state.k = state.v = None

    def load(self, reader, prefix: str) -> None:
        """Read ``{prefix}.{q_proj | q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
        kv_b_proj, o_proj}.weight`` (this rank's heads).

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape.
        """
        if self.mla.q_lora_rank is None:
            self.q_proj.load(reader, [f"{prefix}.q_proj.weight"])
        else:
            self.q_a_proj.load(reader, f"{prefix}.q_a_proj.weight")
            _load_norm(self.q_a_layernorm, reader, f"{prefix}.q_a_layernorm.weight")
            self.q_b_proj.load(reader, [f"{prefix}.q_b_proj.weight"])
        self.kv_a_proj_with_mqa.load(reader, f"{prefix}.kv_a_proj_with_mqa.weight")
        _load_norm(self.kv_a_layernorm, reader, f"{prefix}.kv_a_layernorm.weight")
        self.kv_b_proj.load(reader, [f"{prefix}.kv_b_proj.weight"])
        self.o_proj.load(reader, f"{prefix}.o_proj.weight")
