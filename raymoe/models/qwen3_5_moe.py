"""Qwen3.5-MoE text models (Qwen team; transformers ``Qwen3_5MoeForCausalLM``, ``model_type`` ``qwen3_5_moe_text``; and
the language model of the released image-text checkpoints, ``qwen3_5_moe``: :class:`LanguageModelNames`) on
raymoe's layers: a hybrid of Gated DeltaNet linear attention and gated full attention, every layer MoE with a gated
shared expert (``raymoe.config_linear``).

* **Full-attention layers** (``Qwen35GatedAttention``): GQA whose query projection has a second half per head, the
  output gate: ``o_proj(attn(q, k, v) * sigmoid(gate))``; zero-centered q/k RMSNorm; rotary over the first
  ``partial_rotary_factor`` of each head. Their K/V live in the KV pool, which has one layer per full-attention
  layer only (``kv_layer``).
* **Linear-attention layers** (``GatedDeltaNetAttention``): ``in_proj_qkv`` -> short causal depthwise conv (SiLU) ->
  q, k, v heads; ``beta = sigmoid(in_proj_b x)``, ``g = -exp(A_log) softplus(in_proj_a x + dt_bias)``; the gated
  delta rule (Yang et al. 2024, arXiv:2412.06464) over the request's recurrent state, chunked for prefill rows and
  recurrent for decode rows; gated RMSNorm with ``z = in_proj_z x``; ``out_proj``. Their state lives in the
  per-request ``RecurrentStatePool`` (``raymoe.kvcache.state_pool``), indexed by the request's ReqToTokenPool row.
  Decode steps gather, step and write back every row's states on the device (graph-capturable: the padding rows
  of a decode graph's bucket read table row 0 and write the pool's dummy row).
* RMSNorms are zero-centered (``x * (1 + w)``): ``1 + w`` is loaded into the norm weights.

On CUDA the delta rule runs in flash-linear-attention's kernels where ``fla`` is installed
(``raymoe.platform.cuda.fla_gated_delta``: one varlen chunked call for a step's extend rows, one fused recurrent call
for its decode rows) and the conv in causal-conv1d's where ``causal_conv1d`` is installed and takes the layer's
channels (``raymoe.platform.cuda.causal_conv1d``: per request for extend rows, one in-place update of the pool's
rows for decode).

Limits of this version (the engine's config rules refuse or switch them off, ``raymoe.config.model_rules``): no
radix-cache prefix hits (a prefix's recurrent state is not kept), no prefill/decode disaggregation. Speculative
decoding verifies drafts with per-draft candidate states (``GatedDeltaNetAttention._verify``, ``VerifyStates``);
drafts come from ``ngram``, or with ``enable_mtp`` (``nextn``) from the checkpoint's MTP layer
(``raymoe.models.qwen3_5_mtp``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.config_linear import LinearAttentionConfig
from raymoe.errors import CheckpointError
from raymoe.kvcache.state_pool import RecurrentStatePool, VerifyStates
from raymoe.layers.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    decay_and_beta,
    gated_rms_norm,
    recurrent_gated_delta_rule,
)
from raymoe.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from raymoe.layers.moe import DenseMLP, SparseMoeBlock
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, MoeCausalLM, expert_slots
from raymoe.models.reader_views import RenamedReader
from raymoe.overlap.operations import ForwardState, OpRole, stage_op
from raymoe.platform.interface import Platform
from raymoe.step.host_transfer import to_device


def load_centered(dst: torch.Tensor, reader, name: str) -> None:
    """A zero-centered norm weight ``w`` [D] of the checkpoint as ``1 + w`` into ``dst`` [..., D] (every row).

    Raises:
        CheckpointError: missing tensor or wrong shape.
    """
    w = reader.get(name, dtype=torch.float32)
    if tuple(w.shape) != tuple(dst.shape[-1:]):
        raise CheckpointError(name, f"shape {tuple(w.shape)} does not match {tuple(dst.shape[-1:])}")
    dst.copy_((1.0 + w).to(dst.dtype).expand_as(dst))


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32 times ``weight`` (already ``1 + w``), in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class Qwen35GatedAttention(nn.Module):
    """Gated GQA full attention (module docstring). Ops: ``op_prepare``, ``op_core``.

    Args:
        kv_layer: this layer's index in the KV pool (full-attention layers only).
    """

    fusable = False  # the CPU attention-block kernel has no output gate or partial rotary

    def __init__(self, config: ModelConfig, layer_id: int, kv_layer: int, groups: ParallelGroups,
                 rotary: RotaryEmbedding, dtype: torch.dtype, ops: Platform):
        super().__init__()
        self.layer_id, self.kv_layer, self.head_dim = layer_id, kv_layer, config.head_dim
        # q_proj [2 Hq D, H] is per head (query D, gate D): split as 2 Hq "heads" of D, whole pairs per TP rank
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, groups, dtype, ops, bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, groups,
                                        dtype, ops, bias=config.attention_bias)
        self.q_norm = nn.Parameter(torch.ones(config.head_dim, dtype=dtype), requires_grad=False)
        self.k_norm = nn.Parameter(torch.ones(config.head_dim, dtype=dtype), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.rotary = rotary

    @stage_op(OpRole.ATTN_PREPARE)
    def op_prepare(self, state: ForwardState) -> None:
        x = state.hidden_states
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qg = qkv[:, :2 * hq * d].reshape(t, hq, 2 * d)
        state.attn_gate = qg[..., d:].reshape(t, hq * d)
        pos = state.forward_batch.positions
        q = _head_rms_norm(qg[..., :d], self.q_norm, self.eps)
        k = _head_rms_norm(qkv[:, 2 * hq * d:(2 * hq + hkv) * d].reshape(t, hkv, d), self.k_norm, self.eps)
        state.q, state.k = self.rotary.rotate_partial(pos, q), self.rotary.rotate_partial(pos, k)
        state.v = qkv[:, (2 * hq + hkv) * d:].reshape(t, hkv, d)

    @stage_op(OpRole.ATTN_CORE)
    def op_core(self, state: ForwardState) -> None:
        fb = state.forward_batch
        o = fb.attn_backend.forward(state.q.contiguous(), state.k.contiguous(), state.v, self.kv_layer, fb)
        o = o.reshape(o.shape[0], self.num_heads * self.head_dim) * torch.sigmoid(state.attn_gate)
        state.hidden_states = self.o_proj(o)
        state.q = state.k = state.v = state.attn_gate = None

    def load(self, reader, prefix: str) -> None:
        self.qkv_proj.load(reader, [f"{prefix}.{p}_proj.weight" for p in ("q", "k", "v")])
        self.o_proj.load(reader, f"{prefix}.o_proj.weight")
        load_centered(self.q_norm.data, reader, f"{prefix}.q_norm.weight")
        load_centered(self.k_norm.data, reader, f"{prefix}.k_norm.weight")


def local_linear_config(config: ModelConfig, tp_size: int) -> LinearAttentionConfig:
    """The linear-attention sizes one of ``tp_size`` ranks holds: its share of the key and of the value heads (value
    head ``j`` stays with key head ``j // (Hv / Hk)``: both are split in contiguous runs).

    Raises:
        ValueError: key or value heads not divisible by ``tp_size``.
    """
    lin = config.hybrid.linear
    if lin.num_key_heads % tp_size or lin.num_value_heads % tp_size:
        raise ValueError(f"linear attention heads ({lin.num_key_heads} key, {lin.num_value_heads} value) are not "
                         f"divisible by tp_size {tp_size}")
    return dataclasses.replace(lin, num_key_heads=lin.num_key_heads // tp_size,
                               num_value_heads=lin.num_value_heads // tp_size)


class GatedDeltaNetAttention(nn.Module):
    """Gated DeltaNet linear attention over per-request states (module docstring). Ops: ``op_prepare``
    (projections), ``op_core`` (conv, delta rule, gated norm, out projection). Tensor-parallel by heads: each rank
    projects, convolves and keeps states for its share of the key and value heads (``local_linear_config``);
    ``out_proj`` sums the ranks' parts.

    Args:
        state_layer: this layer's index in the ``RecurrentStatePool``.
    Raises:
        ValueError: heads not divisible by the TP size.
    """

    fusable = False

    def __init__(self, config: ModelConfig, layer_id: int, state_layer: int, groups: ParallelGroups,
                 dtype: torch.dtype, ops: Platform):
        super().__init__()
        full = config.hybrid.linear
        lin = local_linear_config(config, groups.tp_size)
        self.layer_id, self.state_layer, self.cfg, self.groups = layer_id, state_layer, lin, groups
        h = config.hidden_size
        self.in_proj_qkv = ColumnParallelLinear(h, [full.key_dim, full.key_dim, full.value_dim], groups, dtype, ops)
        # the output gate z and the per-head b (write strength) and a (decay) projections, fused into one GEMM
        self.in_proj_zba = ColumnParallelLinear(h, [full.value_dim, full.num_value_heads, full.num_value_heads],
                                                groups, dtype, ops)
        self.out_proj = RowParallelLinear(full.value_dim, h, groups, dtype, ops)
        self.conv_weight = nn.Parameter(torch.zeros(lin.conv_dim, lin.conv_kernel, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(lin.num_value_heads, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(lin.num_value_heads, dtype=torch.float32), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.ones(lin.value_head_dim, dtype=dtype), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.ops = ops
        self.pool: RecurrentStatePool | None = None  # set by the model's create_state_pool
        self.verify: VerifyStates | None = None  # likewise: a verify step's candidate states

    @stage_op(OpRole.ATTN_PREPARE)
    def op_prepare(self, state: ForwardState) -> None:
        x = state.hidden_states
        state.q = self.in_proj_qkv(x)                                              # [T, conv_dim] (pre-conv)
        state.k = self.in_proj_zba(x)                                              # [T, value_dim + 2 Hv]

    @stage_op(OpRole.ATTN_CORE)
    def op_core(self, state: ForwardState) -> None:
        fb, lin = state.forward_batch, self.cfg
        mixed, (z, b, a) = state.q, state.k.split((lin.value_dim, lin.num_value_heads, lin.num_value_heads), dim=-1)
        state.q = state.k = None
        t = mixed.shape[0]
        if t:
            g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
            run = self._decode if fb.forward_mode.is_decode() else self._extend
            out = run(fb, mixed, g, beta)
        else:
            out = mixed.new_empty((0, lin.num_value_heads, lin.value_head_dim))
        y = gated_rms_norm(out, z.reshape(t, lin.num_value_heads, lin.value_head_dim), self.norm_weight, self.eps)
        state.hidden_states = self.out_proj(y.reshape(t, lin.value_dim))

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lin, n = self.cfg, x.shape[0]
        q, k, v = torch.split(x, (lin.key_dim, lin.key_dim, lin.value_dim), dim=-1)
        return (q.reshape(n, lin.num_key_heads, lin.key_head_dim), k.reshape(n, lin.num_key_heads, lin.key_head_dim),
                v.reshape(n, lin.num_value_heads, lin.value_head_dim))

    def _decode(self, fb, mixed, g, beta) -> torch.Tensor:
        """One token per row, batched: gather the rows' states, step them, write them back (padding rows of a
        graph bucket write the pool's dummy row). Returns [bs, Hv, Dv]."""
        pool, li = self.pool, self.state_layer
        rows = fb.req_pool_indices
        dst = rows if fb.padding_mask is None else torch.where(fb.padding_mask, pool.dummy_row, rows)
        conv_kernel = self._conv_kernel()
        if conv_kernel is not None:  # reads and updates the pool rows in place (padding rows: the dummy row)
            y = conv_kernel.decode(mixed, self.conv_weight, pool.conv[li], dst)
        else:
            y, conv = causal_conv1d_decode(mixed, self.conv_weight, pool.conv[li].index_select(0, rows))
            pool.conv[li].index_copy_(0, dst, conv)
        q, k, v = self._split(y)
        kernel = self._kernel()
        states = pool.ssm[li].index_select(0, rows)  # a fresh gather: the torch rule may update it in place
        if kernel is not None:
            o, ssm = kernel.decode(q, k, v, g, beta, states)
        else:
            o, ssm = recurrent_gated_delta_rule(q, k, v, g, beta, states, inplace=True)
        pool.ssm[li].index_copy_(0, dst, ssm)
        return o

    def _kernel(self):
        """The platform's gated-delta kernels (``raymoe.platform.cuda.fla_gated_delta``) where it has them, else
        None (the torch functions)."""
        kernel = getattr(self.ops, "gated_delta", None)
        return kernel if kernel is not None and kernel.available() else None

    def _conv_kernel(self):
        """The platform's causal-conv1d kernels (``raymoe.platform.cuda.causal_conv1d``) where it has them and they
        take this layer's channels and width, else None (the torch functions)."""
        kernel = getattr(self.ops, "causal_conv1d", None)
        if kernel is None or not kernel.supports(self.cfg.conv_dim, self.cfg.conv_kernel):
            return None
        return kernel if kernel.available() else None

    def _extend(self, fb, mixed, g, beta) -> torch.Tensor:
        """A row with a prefix continues from its states (an earlier chunk of the same admission, or a decode row of
        a MIXED step), a row without starts from zeros; the final states are stored. The conv runs row by row; the
        delta rule row by row on torch, or over every row in one varlen call of the platform's kernel. Returns
        [T, Hv, Dv]."""
        if fb.draft_lens_cpu is not None and any(fb.draft_lens_cpu):
            return self._verify(fb, mixed, g, beta, fb.draft_lens_cpu)
        pool, li = self.pool, self.state_layer
        rows, prefixes, lens = fb.req_pool_indices_cpu, fb.prefix_lens_cpu, fb.extend_lens_cpu
        y = torch.empty_like(mixed)
        conv_kernel = self._conv_kernel()
        t0 = 0
        for row, prefix, n in zip(rows, prefixes, lens, strict=True):
            if conv_kernel is not None:
                y[t0:t0 + n], pool.conv[li, row] = conv_kernel.extend_row(
                    mixed[t0:t0 + n], self.conv_weight, pool.conv[li, row] if prefix else None)
            else:
                conv0 = pool.conv[li, row] if prefix else torch.zeros_like(pool.conv[li, row])
                y[t0:t0 + n], pool.conv[li, row] = causal_conv1d_prefill(mixed[t0:t0 + n], self.conv_weight, conv0)
            t0 += n
        q, k, v = self._split(y)
        kernel = self._kernel()
        if kernel is not None:
            rows_t = fb.req_pool_indices
            fresh = to_device([p == 0 for p in prefixes], torch.bool, mixed.device).view(-1, 1, 1, 1)
            states = pool.ssm[li].index_select(0, rows_t).masked_fill_(fresh, 0.0)
            o, finals = kernel.extend(q, k, v, g, beta, lens, states)
            pool.ssm[li].index_copy_(0, rows_t, finals)
            return o
        out = v.new_empty((v.shape[0], self.cfg.num_value_heads, self.cfg.value_head_dim))
        t0 = 0
        for row, prefix, n in zip(rows, prefixes, lens, strict=True):
            t1 = t0 + n
            o, ssm = chunk_gated_delta_rule(q[t0:t1], k[t0:t1], v[t0:t1], g[t0:t1], beta[t0:t1],
                                            pool.ssm[li, row] if prefix else None)
            pool.ssm[li, row] = ssm
            out[t0:t1] = o
            t0 = t1
        return out

    def _verify(self, fb, mixed, g, beta, drafts: list[int]) -> torch.Tensor:
        """A step whose rows end in draft tokens (TARGET_VERIFY, or MIXED with verifying decode rows), on torch: a
        row without drafts as :meth:`_extend`; rows with drafts step the recurrent rule token by token (as plain
        decoding would), batched over the rows of equal length, and stash the conv and recurrent states after the
        newest token and after each draft (``VerifyStates``), of which the rank commits the one its accepted
        drafts reach. The pool row holds the state after every token until then. Returns [T, Hv, Dv]."""
        pool, li, lin = self.pool, self.state_layer, self.cfg
        rows, prefixes, lens = fb.req_pool_indices_cpu, fb.prefix_lens_cpu, fb.extend_lens_cpu
        y = torch.empty_like(mixed)
        convs, verify_rows, t0 = [], [], 0
        for row, prefix, n, k in zip(rows, prefixes, lens, drafts, strict=True):
            conv0 = pool.conv[li, row] if prefix else torch.zeros_like(pool.conv[li, row])
            if k:  # the state after j inputs is the last K-1 columns of (state ++ inputs[:j]); before the row moves
                verify_rows.append(row)
                full = torch.cat([conv0.float(), mixed[t0:t0 + n].float().t()], dim=1)
                width = conv0.shape[1]
                convs.append(torch.stack([full[:, j:j + width] for j in range(n - k, n + 1)]))
            y[t0:t0 + n], pool.conv[li, row] = causal_conv1d_prefill(mixed[t0:t0 + n], self.conv_weight, conv0)
            t0 += n
        q, kk, v = self._split(y)
        out = v.new_empty((v.shape[0], lin.num_value_heads, lin.value_head_dim))
        # rows with drafts step together, one batched recurrent step per token index, grouped by (tokens, drafts)
        groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        t0 = 0
        for row, prefix, n, k in zip(rows, prefixes, lens, drafts, strict=True):
            t1 = t0 + n
            if k:
                groups.setdefault((n, k), []).append((row, t0, prefix))
            else:
                out[t0:t1], pool.ssm[li, row] = chunk_gated_delta_rule(
                    q[t0:t1], kk[t0:t1], v[t0:t1], g[t0:t1], beta[t0:t1], pool.ssm[li, row] if prefix else None)
            t0 = t1
        candidates: dict[int, torch.Tensor] = {}
        dev = mixed.device
        for (n, k), members in groups.items():
            rows_t = to_device([r for r, _, _ in members], torch.int64, dev)
            starts = to_device([s for _, s, _ in members], torch.int64, dev)
            fresh = to_device([p == 0 for _, _, p in members], torch.bool, dev).view(-1, 1, 1, 1)
            s = pool.ssm[li].index_select(0, rows_t).masked_fill_(fresh, 0.0)
            cands = []
            for j in range(n):
                tok = starts + j
                o, s = recurrent_gated_delta_rule(q[tok], kk[tok], v[tok], g[tok], beta[tok], s)
                out[tok] = o
                if j >= n - 1 - k:
                    cands.append(s)
            pool.ssm[li].index_copy_(0, rows_t, s)
            stacked = torch.stack(cands, dim=1)  # [R, k+1, Hv, Dk, Dv]
            for i, (row, _, _) in enumerate(members):
                candidates[row] = stacked[i]
        ssms = [candidates[row] for row in verify_rows]
        width = max(c.shape[0] for c in convs)

        def padded(c: torch.Tensor) -> torch.Tensor:  # rows with fewer drafts repeat their last candidate
            return torch.cat([c, c[-1:].expand(width - c.shape[0], *c.shape[1:])])

        self.verify.stash(li, to_device(verify_rows, torch.int64, mixed.device),
                          torch.stack([padded(c) for c in convs]), torch.stack([padded(s) for s in ssms]))
        return out

    def load(self, reader, prefix: str) -> None:
        self.in_proj_qkv.load_fused(reader, f"{prefix}.in_proj_qkv.weight")
        self.in_proj_zba.load(reader, [f"{prefix}.in_proj_{p}.weight" for p in "zba"])
        self.out_proj.load(reader, f"{prefix}.out_proj.weight")
        tp, r, lin = self.groups.tp_size, self.groups.tp_rank, self.cfg
        conv = reader.get(f"{prefix}.conv1d.weight", dtype=self.conv_weight.dtype)
        if tuple(conv.shape) != (tp * lin.conv_dim, 1, lin.conv_kernel):
            raise CheckpointError(f"{prefix}.conv1d.weight", f"unexpected shape {tuple(conv.shape)}")
        parts = conv[:, 0].split([tp * lin.key_dim, tp * lin.key_dim, tp * lin.value_dim])  # q, k, v channels
        self.conv_weight.data.copy_(torch.cat([p.chunk(tp)[r] for p in parts]))
        for name, dst, split in (("dt_bias", self.dt_bias, True), ("A_log", self.A_log, True),
                                 ("norm.weight", self.norm_weight, False)):
            w = reader.get(f"{prefix}.{name}", dtype=dst.dtype)
            w = w.chunk(tp)[r] if split and w.shape[0] == tp * dst.shape[0] else w
            if tuple(w.shape) != tuple(dst.shape):
                raise CheckpointError(f"{prefix}.{name}", f"unexpected shape {tuple(w.shape)}")
            dst.data.copy_(w)


class Qwen35DecoderLayer(DecoderLayer):
    """A decoder layer with zero-centered norms and its token mixer under the checkpoint's name (``linear_attn`` or
    ``self_attn``)."""

    def __init__(self, *args, mixer_name: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixer_name = mixer_name

    def load(self, reader, prefix: str) -> None:
        self.self_attn.load(reader, f"{prefix}.{self.mixer_name}")
        self.mlp.load(reader, f"{prefix}.{self.mlp_name}")
        load_centered(self.input_layernorm.weight.data, reader, f"{prefix}.input_layernorm.weight")
        load_centered(self.post_attention_layernorm.weight.data, reader, f"{prefix}.post_attention_layernorm.weight")


class LanguageModelNames(RenamedReader):
    """A checkpoint reader view for the released image-text checkpoints (``model_type`` ``qwen3_5_moe``,
    ``Qwen3_5MoeForConditionalGeneration``): raymoe's ``model.*`` names answered with their language model's
    ``model.language_model.*`` tensors (``lm_head.weight`` as it is); the vision tower is never read."""

    @staticmethod
    def disk_name(name: str) -> str:
        """The on-disk name of ``name``."""
        return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


class Qwen3_5MoeForCausalLM(MoeCausalLM):
    """The whole model on one rank (arguments as ``raymoe.models.qwen3_moe.Qwen3MoeForCausalLM``)."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 a2a_backend: str = "torch", enable_sbo: bool = False, expert_location=None, enable_mtp: bool = False):
        super().__init__(config, groups, dtype, ops, enable_sbo)
        self.tp_size = groups.tp_size
        if config.hybrid is None:
            raise ValueError("Qwen3_5MoeForCausalLM needs a qwen3_5_moe_text config")
        rotary = RotaryEmbedding(config, dtype)
        layers, kv, lin = [], 0, 0
        for i in range(config.num_hidden_layers):
            if config.is_linear_layer(i):
                mixer, name, lin = GatedDeltaNetAttention(config, i, lin, groups, dtype, ops), "linear_attn", lin + 1
            else:
                mixer, name, kv = Qwen35GatedAttention(config, i, kv, groups, rotary, dtype, ops), "self_attn", kv + 1
            if not config.is_moe_layer(i):  # Qwen3-Next's mlp_only_layers / decoder_sparse_step
                mlp = DenseMLP(config.hidden_size, config.intermediate_size, groups, dtype, ops)
            else:
                physical, slots = expert_slots(config, i, groups, expert_location)
                mlp = SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                     config.moe_intermediate_size, config.router.norm_topk_prob, groups, dtype, ops,
                                     a2a_backend, router=config.router,
                                     shared_intermediate_size=config.hybrid.shared_expert_intermediate_size,
                                     prefix=f"model.layers.{i}.mlp", shared_name="shared_expert", shared_gate=True,
                                     num_physical_experts=physical, slot_experts=slots)
            layers.append(Qwen35DecoderLayer(i, mixer, mlp, config.hidden_size, config.rms_norm_eps, dtype, ops,
                                             mixer_name=name))
        self.layers = nn.ModuleList(layers)
        full = [layer.self_attn for layer in layers if isinstance(layer.self_attn, Qwen35GatedAttention)]
        if not full:
            raise ValueError("a Qwen3.5-MoE model needs at least one full_attention layer")
        self.num_kv_layers = len(full)
        self.num_local_heads, self.num_local_kv_heads = full[0].num_heads, full[0].num_kv_heads
        self.__dict__["mtp"] = None  # a plain attribute, not a submodule, as DeepSeek's (``enable_mtp``)
        if enable_mtp:
            if config.num_nextn_predict_layers < 1:
                raise ValueError(f"{config.model_type}: enable_mtp, but the config has no MTP layer")
            from raymoe.models.qwen3_5_mtp import Qwen35MTP

            self.__dict__["mtp"] = Qwen35MTP(config, groups, dtype, ops, a2a_backend, rotary, self.num_kv_layers,
                                             self.embed_tokens, self.lm_head)
            self.extra_kv_layers = 1
        self.state_pool: RecurrentStatePool | None = None
        self.verify_states: VerifyStates | None = None

    def create_kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        """K/V of the full-attention layers only (the linear ones keep recurrent states instead), and of the MTP
        layer when it is built."""
        from raymoe.kvcache.pools import TokenToKVPool

        return TokenToKVPool(num_slots, self.num_kv_layers + self.extra_kv_layers, self.num_local_kv_heads,
                             self.config.head_dim, dtype, device)

    def create_state_pool(self, rows: int, device: torch.device | str) -> RecurrentStatePool:
        """The per-request states of the linear-attention layers, ``rows`` request rows (ReqToTokenPool's)."""
        lin = local_linear_config(self.config, self.tp_size)
        self.state_pool = RecurrentStatePool(lin, self.config.num_linear_layers, rows, device)
        self.verify_states = VerifyStates(self.state_pool)
        for layer in self.layers:
            if isinstance(layer.self_attn, GatedDeltaNetAttention):
                layer.self_attn.pool, layer.self_attn.verify = self.state_pool, self.verify_states
        return self.state_pool

    def forward(self, forward_batch) -> torch.Tensor:
        """All layers (``MoeCausalLM.forward``), after forgetting candidate states a failed step left."""
        if self.verify_states is not None:
            self.verify_states.clear()
        return super().forward(forward_batch)

    def commit_verify_states(self, batch_rows: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """After a verify step's acceptance: each row's linear-attention states at its last accepted token
        (``VerifyStates.commit``; ``batch_rows``, ``accept_lens``: [bs] int64 of the step's batch)."""
        if self.verify_states is not None:
            self.verify_states.commit(batch_rows, accept_lens)

    def load_weights(self, reader) -> None:
        """Load the weights (an image-text checkpoint's through :class:`LanguageModelNames`).

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape (names the tensor).
        """
        view = LanguageModelNames(reader) if self.config.model_type == "qwen3_5_moe" else reader
        super().load_weights(view)
        if self.mtp is not None:
            self.mtp.load(view)

    def load_final_norm(self, reader) -> None:
        """The final norm is zero-centered too: ``1 + w``."""
        load_centered(self.norm.weight.data, reader, "model.norm.weight")

