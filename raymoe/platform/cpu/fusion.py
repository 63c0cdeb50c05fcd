"""The CPU platform's fusion of a decoder layer's attention half into one kernel call
(``raymoe.platform.cpu.kernels.attn_block``): input RMSNorm, qkv projection, q/k norm and rotary, KV store, paged
attention, output projection, residual add and post-attention RMSNorm, and for a MoE layer the router projection
and its softmax top-k: about twenty operator calls per layer, about 0.3 ms at 8 tokens of the benchmark model for
under 0.05 ms of arithmetic.

Declared as two :class:`~raymoe.overlap.fusion.Fusion` s over op roles (a MoE layer's six ops, a dense layer's
four), applied to plain forwards only (``raymoe.overlap.forward.LayerSchedules``): the overlap schedules place stage
boundaries inside that run. The builder reads the matched ops' modules (a decoder layer's norms, a Qwen3-MoE or
Mixtral style GQA attention's ``qkv_proj``, ``o_proj``, ``rotary``, per-head q/k norm weights and head counts, a MoE
block's gate and router config) and refuses what the kernel does not cover: projection biases, interleaved rotary,
tensor parallelism (the o projection's all-reduce sits between its ops), routers other than softmax greedy, weights
that are not float32 CPU tensors, models too large for the kernel's GEMM to pay (``attn_block.plan_fits``). The
fused op takes a step only where the backend attends every token with the paged kernel
(``CpuPagedAttnBackend.block_attention_inputs``) and the step is within ``ATTN_BLOCK_MAX_MACS``; otherwise it runs
the ops it replaced, in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raymoe.overlap.fusion import Fusion
from raymoe.overlap.operations import ForwardState, Operation, OpRole
from raymoe.platform.cpu.attention import CpuPagedAttnBackend
from raymoe.platform.cpu.kernels import attn_block, cpu_ops
from raymoe.platform.cpu.kernels.attn_block import AttnBlockPlan

_ATTENTION_HALF = (OpRole.ATTN_INPUT_NORM, OpRole.ATTN_PREPARE, OpRole.ATTN_CORE, OpRole.MLP_INPUT_NORM)


class FusedAttnBlock:
    """The fused op (module docstring): ``state.hidden_states`` [T, H] (the residual stream entering the layer) ->
    ``residual``, post-attention normed ``hidden_states`` and, for a MoE layer, ``topk_weights`` / ``topk_ids``.

    Args:
        plan: the layer's kernel plan. layer_id: its cache layer. routes: the plan includes the router.
        replaced: the ops it stands for, run in turn for a step the kernel does not take.
    """

    def __init__(self, plan: AttnBlockPlan, layer_id: int, routes: bool, replaced: Sequence[Operation]):
        self.plan, self.layer_id, self.routes, self.replaced = plan, layer_id, routes, list(replaced)

    def __call__(self, state: ForwardState) -> None:
        fb, x = state.forward_batch, state.hidden_states
        inputs = None
        if (state.residual is None and 0 < x.shape[0] * self.plan.macs_per_row <= attn_block.ATTN_BLOCK_MAX_MACS
                and isinstance(fb.attn_backend, CpuPagedAttnBackend) and cpu_ops.enabled_for(x)):
            inputs = fb.attn_backend.block_attention_inputs(self.layer_id, fb)
        if inputs is None:
            for op in self.replaced:
                op(state)
            return
        state.residual, state.hidden_states, weights, ids = self.plan(x, fb.positions, fb.out_cache_loc, inputs)
        if self.routes:
            state.topk_weights, state.topk_ids = weights, ids

    def __repr__(self) -> str:
        return f"FusedAttnBlock(layer {self.layer_id}, router={self.routes})"


def _attention_args(attn: Any) -> dict | None:
    """The attention's :class:`AttnBlockPlan` arguments, or None where the kernel does not cover it."""
    qkv, o, rotary = getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None), getattr(attn, "rotary", None)
    if qkv is None or o is None or rotary is None or not getattr(attn, "fusable", True):
        return None
    if qkv.bias is not None or o.bias is not None or rotary.interleaved or o.groups.tp_size != 1:
        return None
    return {"w_qkv": qkv.weight, "w_o": o.weight, "w_qkv_packed": qkv.prepared, "w_o_packed": o.prepared,
            "qk_norm_w": attn.qk_norm_weight if attn.qk_norm else None, "qk_eps": attn.norm_eps,
            "cos": rotary.cos, "sin": rotary.sin, "heads": attn.num_heads, "kv_heads": attn.num_kv_heads,
            "head_dim": attn.head_dim, "scale": attn.head_dim ** -0.5}


def _router_args(moe: Any) -> dict | None:
    """A MoE block's router as :class:`AttnBlockPlan` arguments (softmax greedy top-k without a gate bias), or
    None."""
    r = moe.router
    if not r.is_softmax_greedy or moe.gate.bias is not None:
        return None
    return {"w_gate": moe.gate.weight, "w_gate_packed": moe.gate.prepared, "top_k": moe.top_k,
            "renorm": r.norm_topk_prob, "routed_scale": r.routed_scaling_factor}


def build_attn_block(ops: Sequence[Operation]) -> FusedAttnBlock | None:
    """The fused op of a matched attention half (four ops of a dense layer, or six with a MoE layer's routing),
    or None where the kernel does not cover the layer (module docstring)."""
    layer, attn = getattr(ops[0], "__self__", None), getattr(ops[1], "__self__", None)
    if layer is None or attn is None or getattr(ops[2], "__self__", None) is not attn:
        return None
    routes = len(ops) == 6
    router = _router_args(ops[4].__self__) if routes else {}
    if router is None or (not routes and getattr(layer, "is_moe", False)):
        return None  # a MoE layer fuses its router with its attention or not at all
    weights = _attention_args(attn)
    if weights is None or not attn_block.plan_fits(weights, router):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    args = (*weights.values(), *router.values())
    tensors = [n.weight for n in norms] + [t for t in args if isinstance(t, torch.Tensor)]
    if norms[0].eps != norms[1].eps or not cpu_ops.enabled_for(*tensors):
        return None
    plan = AttnBlockPlan(ln1_w=norms[0].weight, ln2_w=norms[1].weight, norm_eps=norms[0].eps, **weights, **router)
    return FusedAttnBlock(plan, layer.layer_id, routes, ops)


ATTN_BLOCK_FUSIONS = (
    Fusion("attn_block_moe", (*_ATTENTION_HALF, OpRole.ROUTER_GATE, OpRole.ROUTER_TOPK), build_attn_block),
    Fusion("attn_block_dense", _ATTENTION_HALF, build_attn_block),
)
"""The attention-block fusions, longer pattern first."""
