"""Sparse MoE block: top-k softmax router, SwiGLU experts sharded over the EP group, dispatch/combine.

The forward is a sequence of operations on a per-batch state object so that the overlap machinery
(``raymoe.overlap``) can interleave two batches' operations; :meth:`SparseMoeBlock.forward` runs them in order.
Each op reads ``state.<attr>`` written by the previous one:

``op_gate`` (hidden_states -> router_logits) -> ``op_select_experts`` (-> topk_weights, topk_ids) ->
``op_dispatch_a`` / ``op_dispatch_b`` (-> expert inputs) -> ``op_experts`` -> ``op_combine_a`` /
``op_combine_b`` (-> the top-k weighted sum [T, H]) -> ``op_output`` (-> moe_output [T, H]). The dispatch runs
in normal or low-latency mode as the step says (``ForwardBatch.dispatch_capacity``, ``raymoe.comm.dispatcher``);
the padding rows of a decode graph's bucket (``ForwardBatch.padding_mask``) go to it with no expert
(``NO_EXPERT`` ids, weight 0), so no dispatch sends them and no expert computes them.
A block with shared experts (DeepSeek) also has
``op_shared_experts`` (hidden_states -> shared_output), which only needs the block's input, so overlap strategies
may place it anywhere between ``op_gate`` and ``op_output``; ``op_output`` adds it to the routed sum.

Routing is ``raymoe.layers.router.select_experts`` (softmax/sigmoid scores, greedy or group-limited top-k,
correction bias, renormalization, scaling factor); weights are cast to the hidden dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from raymoe.comm.dispatcher import A2ABackendSpec
from raymoe.comm.expert_input import NO_EXPERT, ExpertInput
from raymoe.comm.groups import ParallelGroups, divide, tp_all_reduce
from raymoe.config_arch import RouterConfig
from raymoe.config_quant import Fp8Config
from raymoe.eplb.expert_map import ExpertRouting
from raymoe.errors import CheckpointError
from raymoe.layers.fp8 import fp8_parameters, module_quant, read_fp8, rows_of_scales
from raymoe.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from raymoe.layers.router import select_experts
from raymoe.overlap.operations import OpRole, stage_op
from raymoe.platform.interface import BlockScales, Platform, WeightKind


class DenseMLP(nn.Module):
    """SwiGLU MLP, tensor-parallel: ``x`` [T, H] -> [T, H]. ``quant``: the checkpoint's FP8 format, applied to the
    projections of checkpoint module ``prefix`` (``model.layers.0.mlp``) that ``modules_to_not_convert`` leaves."""

    def __init__(self, hidden_size: int, intermediate_size: int, groups: ParallelGroups, dtype: torch.dtype,
                 ops: Platform, reduce_results: bool = True, quant: Fp8Config | None = None, prefix: str = ""):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, groups, dtype, ops,
                                                 quant=module_quant(quant, f"{prefix}.gate_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, groups, dtype, ops,
                                           reduce_results=reduce_results,
                                           quant=module_quant(quant, f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))

    def load(self, reader, prefix: str) -> None:
        self.gate_up_proj.load(reader, [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"])
        self.down_proj.load(reader, f"{prefix}.down_proj.weight")


class LocalExperts(nn.Module):
    """The experts this rank owns, stacked: ``w13`` [E_local, 2 I_local, H], ``w2`` [E_local, H, I_local].

    With ``ep_size > 1`` each rank owns ``E / ep_size`` whole experts; with ``ep_size == 1`` and
    ``tp_size > 1`` every rank holds all experts with the intermediate dim split (partial sums are
    all-reduced by the caller). With redundant experts (``raymoe.eplb``) ``num_experts`` counts physical slots
    ``P`` and ``slot_experts`` names the logical expert each local slot holds (default: slot ``i`` holds expert
    ``expert_start + i``); load reads those experts, and a rebalance rewrites slots in place
    (:meth:`slot_tensors`, :meth:`refresh_prepared`). The arithmetic is the platform's (``ExpertCompute`` in
    ``raymoe.comm.expert_input``), over these weights and what the platform prepared of them at load
    (``prepared13``, ``prepared2``).
    With ``quant`` both are ``float8_e4m3fn`` with float32 block grids ``w13_scale`` [E_local, ceil(2 I_local / bn),
    ceil(H / bk)] and ``w2_scale`` [E_local, ceil(H / bn), ceil(I_local / bk)] (``raymoe.layers.fp8``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, groups: ParallelGroups,
                 dtype: torch.dtype, ops: Platform, quant: Fp8Config | None = None,
                 slot_experts: Sequence[int] | None = None):
        super().__init__()
        self.groups = groups
        self.ops = ops
        self.num_local = divide(num_experts, groups.ep_size, "num_experts over ep_size")
        self.expert_start = groups.ep_rank * self.num_local
        self.slot_experts = (list(range(self.expert_start, self.expert_start + self.num_local))
                             if slot_experts is None else list(slot_experts))
        if len(self.slot_experts) != self.num_local:
            raise ValueError(f"slot_experts has {len(self.slot_experts)} entries for {self.num_local} local slots")
        self.tp_split = groups.tp_size if groups.ep_size == 1 else 1
        self.inter_local = divide(intermediate_size, self.tp_split, "moe_intermediate_size over tp_size")
        self.quant = quant
        shape13 = (self.num_local, 2 * self.inter_local, hidden_size)
        shape2 = (self.num_local, hidden_size, self.inter_local)
        if quant is None:
            self.w13 = nn.Parameter(torch.empty(shape13, dtype=dtype), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(shape2, dtype=dtype), requires_grad=False)
            self.w13_scale = self.w2_scale = self.block13 = self.block2 = None
        else:
            self.w13, self.w13_scale, self.block13 = fp8_parameters(shape13, quant, [self.inter_local] * 2)
            self.w2, self.w2_scale, self.block2 = fp8_parameters(shape2, quant)
        self.prepared13 = self.prepared2 = None

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Apply expert ``local_ids[i]`` to row ``x[i]``: ``x`` [R, H], ``local_ids`` [R] int64 in
        ``[0, E_local)`` -> [R, H] in ``x``'s dtype (R may be 0)."""
        return self.ops.expert_rows(x, local_ids, self)

    def forward_input(self, rows: ExpertInput) -> torch.Tensor:
        """Apply the experts to a dispatch's answer, in its layout (``raymoe.comm.expert_input``), answering in
        that layout: [R, H] for pair rows, [E_local, C, H] for the masked layout, [R_max, H] for sorted segments,
        the weighted sums for token rows."""
        return rows.compute(self.ops, self)

    def load(self, reader, prefix: str) -> None:
        """Read ``{prefix}.E.{gate,up,down}_proj.weight`` (and FP8 scales) for the local experts only.

        Raises:
            CheckpointError: a tensor is missing, has the wrong shape or dtype, or (FP8) a TP cut is not on a
                scale block.
        """
        i0 = self.groups.tp_rank * self.inter_local if self.tp_split > 1 else 0
        i1 = i0 + self.inter_local
        if self.quant is not None:
            self._load_fp8(reader, prefix, i0, i1)
            return
        for le, e in enumerate(self.slot_experts):
            base = f"{prefix}.{e}"
            for j, part in enumerate(("gate_proj", "up_proj")):
                w = reader.get_slice(f"{base}.{part}.weight", 0, i0, i1, dtype=self.w13.dtype)
                if tuple(w.shape) != (self.inter_local, self.w13.shape[2]):
                    raise CheckpointError(f"{base}.{part}.weight", f"unexpected shape {tuple(w.shape)}")
                self.w13.data[le, j * self.inter_local:(j + 1) * self.inter_local].copy_(w)
            w = reader.get_slice(f"{base}.down_proj.weight", 1, i0, i1, dtype=self.w2.dtype)
            if tuple(w.shape) != tuple(self.w2.shape[1:]):
                raise CheckpointError(f"{base}.down_proj.weight", f"unexpected shape {tuple(w.shape)}")
            self.w2.data[le].copy_(w)
        self.refresh_prepared()

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor (dim 0 = local slot): ``w13``, ``w2`` and, FP8, their scales; what a rebalance
        moves between ranks (``raymoe.eplb.weight_mover``)."""
        return [t.data for t in (self.w13, self.w2, self.w13_scale, self.w2_scale) if t is not None]

    def refresh_prepared(self, slots: Sequence[int] | None = None) -> None:
        """What the platform prepares of the weights (packed copies, FP8 scale layouts), again: after a load
        (``slots`` None), or for the local slots ``slots`` a rebalance rewrote in place (the platform's
        ``prepare_weight_slots``: only those slots where its prepared form allows)."""
        if slots is not None:
            s13 = s2 = None
            if self.quant is not None:
                s13, s2 = BlockScales(self.w13_scale.data, self.block13), BlockScales(self.w2_scale.data, self.block2)
            self.prepared13 = self.ops.prepare_weight_slots(self.w13, WeightKind.EXPERTS, self.prepared13, slots, s13)
            self.prepared2 = self.ops.prepare_weight_slots(self.w2, WeightKind.EXPERTS, self.prepared2, slots, s2)
            return
        if self.quant is None:
            self.prepared13 = self.ops.prepare_weight(self.w13, WeightKind.EXPERTS)
            self.prepared2 = self.ops.prepare_weight(self.w2, WeightKind.EXPERTS)
        else:
            self.prepared13 = self.ops.prepare_weight(self.w13, WeightKind.EXPERTS,
                                                      BlockScales(self.w13_scale.data, self.block13))
            self.prepared2 = self.ops.prepare_weight(self.w2, WeightKind.EXPERTS,
                                                     BlockScales(self.w2_scale.data, self.block2))

    def _load_fp8(self, reader, prefix: str, i0: int, i1: int) -> None:
        """The FP8 experts' weights and block scales (rows ``[i0, i1)`` of gate/up, columns of down)."""
        n = self.inter_local
        g = -(-n // self.block13[0])                        # scale rows per part (n // bn: parts are whole blocks)
        for le, e in enumerate(self.slot_experts):
            base = f"{prefix}.{e}"
            for j, part in enumerate(("gate_proj", "up_proj")):
                name = f"{base}.{part}.weight"
                w, s = read_fp8(reader, name, self.quant, (i0, i1))
                s = rows_of_scales(s, self.quant, n, self.block13)
                if tuple(w.shape) != (n, self.w13.shape[2]) or tuple(s.shape) != (g, self.w13_scale.shape[2]):
                    raise CheckpointError(name, f"unexpected shape {tuple(w.shape)} (scales {tuple(s.shape)})")
                self.w13.data[le, j * n:(j + 1) * n].copy_(w)
                self.w13_scale.data[le, j * g:(j + 1) * g].copy_(s)
            name = f"{base}.down_proj.weight"
            w, s = read_fp8(reader, name, self.quant, None, (i0, i1))
            if tuple(w.shape) != tuple(self.w2.shape[1:]) or tuple(s.shape) != tuple(self.w2_scale.shape[1:]):
                raise CheckpointError(name, f"unexpected shape {tuple(w.shape)} (scales {tuple(s.shape)})")
            self.w2.data[le].copy_(w)
            self.w2_scale.data[le].copy_(s)
        self.refresh_prepared()


class SparseMoeBlock(nn.Module):
    """Routed experts with expert-parallel dispatch/combine. ``state.hidden_states`` [T, H] -> ``state.moe_output``.

    Args:
        num_experts, top_k, hidden_size, intermediate_size: from the model config.
        norm_topk_prob: renormalize the top-k probabilities to sum to 1 (used when ``router`` is None).
        groups: explicit process groups (EP group for dispatch/combine, TP group when experts are TP-split).
        dtype: parameter dtype. ops: the rank's platform (routing, expert arithmetic, the dispatcher it builds).
        a2a_backend: the all-to-all backend: a name (``"torch"``, ``"deepep"`` with default options) or an
            :class:`~raymoe.comm.dispatcher.A2ABackendSpec` (DeepEP's buffer options).
        router: routing variant (None: softmax greedy top-k with ``norm_topk_prob``, the Qwen3-MoE rule).
        shared_intermediate_size: intermediate size of the shared-experts MLP (DeepSeek: ``n_shared *
            moe_intermediate_size``), tensor-parallel like a dense MLP; 0: no shared experts.
        shared_name: the shared MLP's checkpoint name (``"shared_experts"``; Qwen2/Qwen3.5-MoE: ``"shared_expert"``).
        shared_gate: scale the shared MLP's output per token by ``sigmoid(x @ shared_expert_gate^T)`` (a
            replicated [1, H] gate; Qwen2-MoE and Qwen3.5-MoE).
        quant, prefix: the checkpoint's FP8 format and this block's checkpoint module (``model.layers.3.mlp``):
            experts and shared experts are FP8 unless ``modules_to_not_convert`` lists them; the router gate
            never is (DeepSeek and Qwen3 keep it in bfloat16).
        num_physical_experts, slot_experts: redundant experts (``raymoe.eplb``): the EP group's physical slots
            ``P >= num_experts`` and the logical expert of each of this rank's ``P / ep_size`` slots (None: one
            slot per expert). The dispatch then carries physical ids: ``expert_routing`` (an
            :class:`~raymoe.eplb.expert_map.ExpertRouting`, set by the runner) maps the router's choice.

    Attributes:
        expert_routing: logical -> physical map and load counter of this layer, or None (ids are slots).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 norm_topk_prob: bool, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 a2a_backend: str | A2ABackendSpec = "torch",
                 router: RouterConfig | None = None, shared_intermediate_size: int = 0,
                 quant: Fp8Config | None = None, prefix: str = "", num_physical_experts: int | None = None,
                 slot_experts: Sequence[int] | None = None, shared_name: str = "shared_experts",
                 shared_gate: bool = False):
        super().__init__()
        self.groups = groups
        self.num_experts = num_experts
        self.num_physical_experts = num_physical_experts or num_experts
        self.expert_routing: ExpertRouting | None = None
        self.ops = ops
        self.top_k = top_k
        self.router = router or RouterConfig(norm_topk_prob=norm_topk_prob)
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype, ops)
        if self.router.use_correction_bias:  # float32, as DeepSeek keeps it
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.experts = LocalExperts(self.num_physical_experts, hidden_size, intermediate_size, groups, dtype, ops,
                                    quant=module_quant(quant, f"{prefix}.experts"), slot_experts=slot_experts)
        self.shared_name = shared_name
        self.shared_experts = (DenseMLP(hidden_size, shared_intermediate_size, groups, dtype, ops, quant=quant,
                                        prefix=f"{prefix}.{shared_name}")
                               if shared_intermediate_size else None)
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, dtype, ops)
                                   if shared_gate and shared_intermediate_size else None)
        spec = a2a_backend if isinstance(a2a_backend, A2ABackendSpec) else A2ABackendSpec(a2a_backend)
        experts_quant = module_quant(quant, f"{prefix}.experts")
        fp8_experts = experts_quant is not None and tuple(experts_quant.weight_block_size or ()) == (128, 128)
        self.a2a = ops.create_dispatcher(spec, groups, self.num_physical_experts, hidden_size, dtype,
                                         self.experts.inter_local, fp8_experts=fp8_experts)

    # ---- operations (see module docstring) ----
    @stage_op(OpRole.ROUTER_GATE)
    def op_gate(self, state) -> None:
        state.router_logits = self.gate(state.hidden_states)

    @stage_op(OpRole.ROUTER_TOPK)
    def op_select_experts(self, state) -> None:
        weights, ids = select_experts(self.ops, state.router_logits, self.top_k, self.router,
                                      self.e_score_correction_bias)
        state.topk_weights = weights.to(state.hidden_states.dtype)
        state.topk_ids = ids

    @stage_op(OpRole.SHARED_EXPERTS)
    def op_shared_experts(self, state) -> None:
        """Shared experts on the block input: ``hidden_states`` [T, H] -> ``shared_output`` [T, H] (TP-reduced)."""
        state.shared_output = self.shared_experts(state.hidden_states)
        if self.shared_expert_gate is not None:
            state.shared_output = state.shared_output * torch.sigmoid(self.shared_expert_gate(state.hidden_states))

    @stage_op(OpRole.DISPATCH_A)
    def op_dispatch_a(self, state) -> None:
        """Start the dispatch; low-latency when the step's ``forward_batch.dispatch_capacity`` is set. Rows of
        ``forward_batch.padding_mask`` (a graph bucket's padding) are dispatched with ``NO_EXPERT`` ids and
        weight 0. With ``expert_routing`` the pairs are counted per logical expert and sent to physical slots."""
        capacity = getattr(state.forward_batch, "dispatch_capacity", None)
        padding = getattr(state.forward_batch, "padding_mask", None)
        ids, weights = state.topk_ids, state.topk_weights
        if padding is not None:
            ids = ids.masked_fill(padding.unsqueeze(1), NO_EXPERT)
            weights = weights.masked_fill(padding.unsqueeze(1), 0)
        if self.expert_routing is not None:
            self.expert_routing.count(ids)
            ids = self.expert_routing.to_physical(ids)
        state.dispatch_handle = self.a2a.dispatch_a(state.hidden_states, ids, weights, capacity)

    @stage_op(OpRole.DISPATCH_B)
    def op_dispatch_b(self, state) -> None:
        state.expert_input = self.a2a.dispatch_b(state.dispatch_handle)

    @stage_op(OpRole.EXPERTS)
    def op_experts(self, state) -> None:
        state.expert_output = self.experts.forward_input(state.expert_input)
        state.expert_input = None

    @stage_op(OpRole.COMBINE_A)
    def op_combine_a(self, state) -> None:
        self.a2a.combine_a(state.dispatch_handle, state.expert_output)
        state.expert_output = None

    @stage_op(OpRole.COMBINE_B)
    def op_combine_b(self, state) -> None:
        state.combined = self.a2a.combine_b(state.dispatch_handle)
        state.dispatch_handle = None

    @stage_op(OpRole.OUTPUT)
    def op_output(self, state) -> None:
        out = state.combined  # [T, H], already weighted by the combine
        if self.experts.tp_split > 1:
            tp_all_reduce(out, self.groups)
        if self.shared_experts is not None:
            out = out + state.shared_output
            state.shared_output = None
        state.moe_output = out
        state.combined = state.router_logits = state.topk_weights = state.topk_ids = None

    def routing_operations(self) -> list:
        """The block's first ops: router logits, then the top-k choice."""
        return [self.op_gate, self.op_select_experts]

    def expert_operations(self) -> list:
        """The ops after the routing, in execution order (shared experts, when present, right after
        ``op_dispatch_a`` so they compute while the dispatch is in flight)."""
        shared = [self.op_shared_experts] if self.shared_experts is not None else []
        return [self.op_dispatch_a, *shared, self.op_dispatch_b, self.op_experts, self.op_combine_a,
                self.op_combine_b, self.op_output]

    def operations(self) -> list:
        """The block's op list, in execution order."""
        return [*self.routing_operations(), *self.expert_operations()]

    def load(self, reader, prefix: str) -> None:
        self.gate.load(reader, f"{prefix}.gate.weight")
        if self.e_score_correction_bias is not None:
            name = f"{prefix}.gate.e_score_correction_bias"
            bias = reader.get(name, dtype=torch.float32)
            if tuple(bias.shape) != tuple(self.e_score_correction_bias.shape):
                raise CheckpointError(name, f"unexpected shape {tuple(bias.shape)}")
            self.e_score_correction_bias.copy_(bias)
        self.experts.load(reader, f"{prefix}.experts")
        if self.shared_experts is not None:
            self.shared_experts.load(reader, f"{prefix}.{self.shared_name}")
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.load(reader, f"{prefix}.shared_expert_gate.weight")
