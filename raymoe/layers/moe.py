"""Sparse MoE block: top-k softmax router, SwiGLU experts sharded over the EP group, dispatch/combine.

The forward is a sequence of operations on a per-batch state object so that the overlap machinery
(``raymoe.overlap``) can interleave two batches' operations; :meth:`SparseMoeBlock.forward` runs them in order.
Each op reads ``state.<attr>`` written by the previous one:

``op_gate`` (hidden_states -> router_logits) -> ``op_select_experts`` (-> topk_weights, topk_ids) ->
``op_dispatch_a`` / ``op_dispatch_b`` (-> expert inputs) -> ``op_experts`` -> ``op_combine_a`` /
``op_combine_b`` (-> the top-k weighted sum [T, H]) -> ``op_output`` (-> moe_output [T, H]). The dispatch runs
in normal or low-latency mode as the step says (``ForwardBatch.dispatch_capacity``, ``raymoe.comm.dispatcher``).
A block with shared experts (DeepSeek) also has
``op_shared_experts`` (hidden_states -> shared_output), which only needs the block's input, so overlap strategies
may place it anywhere between ``op_gate`` and ``op_output``; ``op_output`` adds it to the routed sum.

Routing is ``raymoe.layers.router.select_experts`` (softmax/sigmoid scores, greedy or group-limited top-k,
correction bias, renormalization, scaling factor); weights are cast to the hidden dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raymoe.comm.dispatcher import A2ABackendSpec, get_all_to_all_backend
from raymoe.comm.expert_input import (
    DenseExpertRows,
    ExpertRows,
    GroupedExpertRows,
    MaskedExpertRows,
    RoutedTokenRows,
)
from raymoe.comm.groups import ParallelGroups, divide, tp_all_reduce
from raymoe.config_arch import RouterConfig
from raymoe.errors import CheckpointError
from raymoe.layers.activation import silu_and_mul
from raymoe.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from raymoe.layers.router import select_experts
from raymoe.overlap.operations import OpRole, stage_op
from raymoe.platform.cpu.kernels import cpu_ops, packed_linear

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes on CPU


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether the experts can run ``torch._grouped_mm`` on rows ``x``: CPU, a dtype it takes, not under
    ``torch.compile`` (its shape rule for the op accepts bf16 only)."""
    return (x.device.type == "cpu" and x.dtype in _GROUPED_MM_DTYPES and hasattr(torch, "_grouped_mm")
            and not torch.compiler.is_compiling())


class DenseMLP(nn.Module):
    """SwiGLU MLP, tensor-parallel: ``x`` [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, groups: ParallelGroups, dtype: torch.dtype,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, groups, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, groups, dtype,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def load(self, reader, prefix: str) -> None:
        self.gate_up_proj.load(reader, [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"])
        self.down_proj.load(reader, f"{prefix}.down_proj.weight")


class LocalExperts(packed_linear.PackedWeightsMixin, nn.Module):
    """The experts this rank owns, stacked: ``w13`` [E_local, 2 I_local, H], ``w2`` [E_local, H, I_local].

    With ``ep_size > 1`` each rank owns ``E / ep_size`` whole experts; with ``ep_size == 1`` and
    ``tp_size > 1`` every rank holds all experts with the intermediate dim split (partial sums are
    all-reduced by the caller).

    On a float32 CPU rank both stacks are also kept packed (``packed13``, ``packed2``), and the grouped paths run
    the packed GEMM (``raymoe.platform.cpu.kernels.packed_linear``) where :func:`~raymoe.platform.cpu.kernels.packed_linear.use_packed` says so.
    """

    PACKED = (("packed13", "w13"), ("packed2", "w2"))

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, groups: ParallelGroups,
                 dtype: torch.dtype):
        super().__init__()
        self.groups = groups
        self.num_local = divide(num_experts, groups.ep_size, "num_experts over ep_size")
        self.expert_start = groups.ep_rank * self.num_local
        self.tp_split = groups.tp_size if groups.ep_size == 1 else 1
        self.inter_local = divide(intermediate_size, self.tp_split, "moe_intermediate_size over tp_size")
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter_local, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.inter_local, dtype=dtype),
                               requires_grad=False)
        self.packed13: packed_linear.PackedWeight | None = None
        self.packed2: packed_linear.PackedWeight | None = None

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Apply expert ``local_ids[i]`` to row ``x[i]``: ``x`` [R, H], ``local_ids`` [R] int64 in
        ``[0, E_local)`` -> [R, H] in ``x``'s dtype (R may be 0).

        Rows are sorted by expert into contiguous segments and both projections run as one grouped GEMM over
        the segments (:meth:`forward_grouped`): no Python loop over experts and no host sync, so its cost
        does not depend on how many experts got rows. Where grouped GEMMs are unavailable (non-CPU devices,
        float64, under ``torch.compile``) it runs one GEMM per non-empty expert (:meth:`forward_loop`); both give
        the same rows.
        """
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if _grouped_mm_ok(x):
            return self.forward_grouped(x, local_ids)
        return self.forward_loop(x, local_ids)

    def forward_grouped(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` as two ``torch._grouped_mm`` calls over expert-sorted rows (float32/bfloat16/float16).

        Segment ends are cumulative per-expert row counts [E_local] int32 computed on the device (an empty
        expert is an empty segment), so the shapes depend on R only.
        """
        order = torch.argsort(local_ids, stable=True)
        counts = torch.zeros(self.num_local, dtype=torch.int64, device=x.device)
        counts.index_add_(0, local_ids, torch.ones_like(local_ids))
        ends = counts.cumsum(0).to(torch.int32)
        xs = x.index_select(0, order)                                                   # [R, H] by expert
        y = self._grouped(xs, ends)                                                     # [R, H]
        return torch.empty_like(x).index_copy_(0, order, y)

    def _grouped(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Both projections over expert segments (``ends`` [E_local] int32): the packed GEMM where it applies,
        else ``torch._grouped_mm``. ``x`` [R, H] -> [R, H]."""
        if packed_linear.use_packed(self.packed13, x):
            h = silu_and_mul(packed_linear.grouped_linear(x, ends, self.packed13))      # [R, I_local]
            return packed_linear.grouped_linear(h, ends, self.packed2)
        h = silu_and_mul(torch._grouped_mm(x, self.w13.transpose(1, 2), offs=ends))     # [R, I_local]
        return torch._grouped_mm(h, self.w2.transpose(1, 2), offs=ends)

    def forward_input(self, rows: ExpertRows | MaskedExpertRows | GroupedExpertRows | DenseExpertRows
                      | RoutedTokenRows) -> torch.Tensor:
        """Apply the experts to a dispatch's answer, in its layout: [R, H] for :class:`ExpertRows`,
        [E_local, C, H] for :class:`MaskedExpertRows` (:meth:`forward_masked`), [R_max, H] for
        :class:`GroupedExpertRows` (:meth:`forward_segments`), the weighted sums [R, H] for
        :class:`DenseExpertRows` (:meth:`forward_dense`) and [B * M, H] for :class:`RoutedTokenRows` (float32 CPU
        experts: the fused kernel over the routed pairs only, ``raymoe.platform.cpu.kernels.cpu_ops.moe_routed_rows``; else
        as dense rows)."""
        if isinstance(rows, GroupedExpertRows):
            return self.forward_segments(rows.x, rows.ends, rows.expert_capacity)
        if isinstance(rows, RoutedTokenRows):
            if cpu_ops.enabled_for(rows.x, rows.topk_weights, self.w13, self.w2):
                return cpu_ops.moe_routed_rows(rows.x, rows.topk_ids, rows.topk_weights, rows.first_expert, self.w13,
                                               self.w2)
            rows = rows.dense(self.num_local)
        if isinstance(rows, DenseExpertRows):
            return self.forward_dense(rows.x, rows.weights)
        if isinstance(rows, MaskedExpertRows):
            return self.forward_masked(rows.x)
        return self(rows.x, rows.local_ids)

    def forward_segments(self, x: torch.Tensor, ends: torch.Tensor, expert_capacity: int) -> torch.Tensor:
        """Expert ``e`` on rows ``[ends[e - 1], ends[e])`` of ``x`` [R_max, H] (``ends`` [E_local] int32 on the
        device; expert 0 starts at row 0; no expert has more than ``expert_capacity`` rows) -> [R_max, H]; rows
        from ``ends[-1]`` on are padding in and out.

        One ``torch._grouped_mm`` per projection over the segments, as :meth:`forward_grouped` (no sort: the rows
        come sorted), so only the received rows are multiplied; shapes depend on ``R_max`` only and nothing is read
        on the host, so a decode graph can hold it. Without grouped GEMMs (non-CPU devices, float64, under
        ``torch.compile``) the rows are spread into the masked layout [E_local, expert_capacity, H] and run there
        (:meth:`forward_masked`).
        """
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if _grouped_mm_ok(x):
            return self._grouped(x, ends)                                                 # [R_max, H]
        r, el, c = x.shape[0], self.num_local, expert_capacity
        ends = ends.to(torch.int64)
        starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))                      # [E_local]
        slot = torch.arange(c, device=x.device)
        spread = (starts.view(el, 1) + slot.view(1, c)).clamp_(max=r - 1)               # [E_local, C]
        y = self.forward_masked(x.index_select(0, spread.view(-1)).view(el, c, -1))      # [E_local, C, H]
        pos = torch.arange(r, device=x.device)
        expert = torch.searchsorted(ends, pos, right=True).clamp_(max=el - 1)            # [R_max]
        return y.view(el * c, -1).index_select(0, expert * c + (pos - starts[expert]).clamp_(0, c - 1))

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every local expert over every row, weighted and summed: ``x`` [R, H], ``weights`` [R, E_local] ->
        ``sum_e weights[:, e] * expert_e(x)`` [R, H] in ``x``'s dtype.

        Two batched GEMMs ([E_local, R, 2 I] then [E_local, R, H]) and one weighted reduction over the experts, in
        expert order; a row adds exact zeros for the experts it did not pick. Worth it only where ``R * E_local``
        is small (:data:`~raymoe.comm.low_latency.DENSE_EXPERT_MAC_BUDGET`): the other layouts multiply only routed
        rows. The GEMMs block differently from the grouped ones, so results agree with them to rounding.
        """
        h = silu_and_mul(torch.matmul(x, self.w13.transpose(1, 2)))     # [E_local, R, I_local]
        y = torch.bmm(h, self.w2.transpose(1, 2))                        # [E_local, R, H]
        return (y * weights.t().unsqueeze(-1)).sum(dim=0)

    def forward_masked(self, x: torch.Tensor) -> torch.Tensor:
        """Every row of the low-latency layout through its expert: ``x`` [E_local, C, H] -> [E_local, C, H].

        Two batched GEMMs over all ``C`` rows of every expert, valid or not (a row's output depends on that row
        only, so the invalid rows, which the combine never reads, cannot disturb the valid ones). Shapes depend
        on ``C`` only, which is what a decode graph needs; a GPU masked grouped GEMM would skip the invalid rows.
        """
        h = silu_and_mul(torch.bmm(x, self.w13.transpose(1, 2)))       # [E_local, C, I_local]
        return torch.bmm(h, self.w2.transpose(1, 2))                    # [E_local, C, H]

    def forward_loop(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with one pair of GEMMs per non-empty expert (any dtype; syncs for the row counts)."""
        out = torch.empty_like(x)
        if x.shape[0] == 0:
            return out
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=self.num_local).tolist()
        xs = x[order]
        outs = []
        start = 0
        for e, c in enumerate(counts):
            if c:
                h = silu_and_mul(F.linear(xs[start:start + c], self.w13[e]))
                outs.append(F.linear(h, self.w2[e]))
                start += c
        out[order] = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out

    def load(self, reader, prefix: str) -> None:
        """Read ``{prefix}.E.{gate,up,down}_proj.weight`` for the local experts only."""
        i0 = self.groups.tp_rank * self.inter_local if self.tp_split > 1 else 0
        i1 = i0 + self.inter_local
        for le in range(self.num_local):
            e = self.expert_start + le
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
        self.repack()


class SparseMoeBlock(nn.Module):
    """Routed experts with expert-parallel dispatch/combine. ``state.hidden_states`` [T, H] -> ``state.moe_output``.

    Args:
        num_experts, top_k, hidden_size, intermediate_size: from the model config.
        norm_topk_prob: renormalize the top-k probabilities to sum to 1 (used when ``router`` is None).
        groups: explicit process groups (EP group for dispatch/combine, TP group when experts are TP-split).
        a2a_backend: the all-to-all backend: a name (``"torch"``, ``"deepep"`` with default options) or an
            :class:`~raymoe.comm.dispatcher.A2ABackendSpec` (DeepEP's buffer options).
        router: routing variant (None: softmax greedy top-k with ``norm_topk_prob``, the Qwen3-MoE rule).
        shared_intermediate_size: intermediate size of the shared-experts MLP (DeepSeek: ``n_shared *
            moe_intermediate_size``), tensor-parallel like a dense MLP; 0: no shared experts.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 norm_topk_prob: bool, groups: ParallelGroups, dtype: torch.dtype,
                 a2a_backend: str | A2ABackendSpec = "torch",
                 router: RouterConfig | None = None, shared_intermediate_size: int = 0):
        super().__init__()
        self.groups = groups
        self.top_k = top_k
        self.router = router or RouterConfig(norm_topk_prob=norm_topk_prob)
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype)
        if self.router.use_correction_bias:  # float32, as DeepSeek keeps it
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.experts = LocalExperts(num_experts, hidden_size, intermediate_size, groups, dtype)
        self.shared_experts = (DenseMLP(hidden_size, shared_intermediate_size, groups, dtype)
                               if shared_intermediate_size else None)
        spec = a2a_backend if isinstance(a2a_backend, A2ABackendSpec) else A2ABackendSpec(a2a_backend)
        self.a2a = get_all_to_all_backend(spec.name, groups, num_experts,
                                          **spec.options(hidden_size, dtype, self.experts.inter_local))

    # ---- operations (see module docstring) ----
    def op_gate(self, state) -> None:
        state.router_logits = self.gate(state.hidden_states)

    def op_select_experts(self, state) -> None:
        weights, ids = select_experts(state.router_logits, self.top_k, self.router, self.e_score_correction_bias)
        state.topk_weights = weights.to(state.hidden_states.dtype)
        state.topk_ids = ids

    @stage_op(OpRole.SHARED_EXPERTS)
    def op_shared_experts(self, state) -> None:
        """Shared experts on the block input: ``hidden_states`` [T, H] -> ``shared_output`` [T, H] (TP-reduced)."""
        state.shared_output = self.shared_experts(state.hidden_states)

    @stage_op(OpRole.DISPATCH_A)
    def op_dispatch_a(self, state) -> None:
        """Start the dispatch; low-latency when the step's ``forward_batch.dispatch_capacity`` is set."""
        capacity = getattr(state.forward_batch, "dispatch_capacity", None)
        state.dispatch_handle = self.a2a.dispatch_a(state.hidden_states, state.topk_ids, state.topk_weights,
                                                    capacity)

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

    def fused_router(self) -> dict | None:
        """The router as keyword arguments of :class:`~raymoe.platform.cpu.kernels.attn_block.AttnBlockPlan` (``w_gate`` and its
        packed copy, ``top_k``, ``renorm``, ``routed_scale``) where the fused attention block can route (softmax,
        greedy top-k, no correction bias, no gate bias); else None."""
        r = self.router
        if not r.is_softmax_greedy or self.gate.bias is not None:
            return None
        return {"w_gate": self.gate.weight, "w_gate_packed": self.gate.packed, "top_k": self.top_k,
                "renorm": r.norm_topk_prob, "routed_scale": r.routed_scaling_factor}

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
            self.shared_experts.load(reader, f"{prefix}.shared_experts")
