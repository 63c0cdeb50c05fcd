"""Reference expert computations (SwiGLU experts, Shazeer 2020) over each layout a dispatch hands the local experts
(``raymoe.comm.expert_input``), in torch operators. The methods of :class:`ExpertOps` implement the expert part of
:class:`~raymoe.platform.interface.Platform`; shapes are in its docstrings.

Grouped GEMMs (``torch._grouped_mm``) run over expert-sorted rows where torch has them for the device and dtype (CPU:
float32, bfloat16, float16; not under ``torch.compile``, whose shape rule takes bfloat16 only): one GEMM per
projection whatever the number of experts with rows, shapes that depend on the row count only, no host sync.
Elsewhere rows run one GEMM pair per non-empty expert (a host sync for the counts), and fixed-shape segments are
spread into the masked layout. FP8 experts (``prepared13`` holds their ``BlockScales``) are block-dequantized to the
rows' dtype at the start of each operation (``fp8.dense_experts``: weight-only, the FP8 weights stay resident).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raymoe.comm.expert_input import ExpertWeights, RoutedTokenRows
from raymoe.platform.reference.fp8 import dense_experts

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes on CPU


def grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes rows ``x`` here: CPU, a dtype it takes, outside ``torch.compile``."""
    return (x.device.type == "cpu" and x.dtype in _GROUPED_MM_DTYPES and hasattr(torch, "_grouped_mm")
            and not torch.compiler.is_compiling())


class ExpertOps:
    """Torch implementations of the platform's expert operations."""

    def grouped_mlp(self, x: torch.Tensor, ends: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Both projections over expert segments (``ends`` [E_local] int32): ``x`` [R, H] -> [R, H] with
        ``torch._grouped_mm`` (callers check :func:`grouped_mm_ok`). Platforms with a faster grouped GEMM override
        it."""
        h = self.silu_and_mul(torch._grouped_mm(x, experts.w13.transpose(1, 2), offs=ends))    # [R, I_local]
        return torch._grouped_mm(h, experts.w2.transpose(1, 2), offs=ends)

    def expert_rows(self, x: torch.Tensor, local_ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Rows sorted by expert into segments, then :meth:`grouped_mlp` (no Python loop over experts, no host
        sync); without grouped GEMMs one pair of GEMMs per non-empty expert. Both give the same rows."""
        experts = dense_experts(experts, x.dtype, self.weight_values)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if not grouped_mm_ok(x):
            return self._expert_loop(x, local_ids, experts)
        order = torch.argsort(local_ids, stable=True)
        counts = torch.zeros(experts.num_local, dtype=torch.int64, device=x.device)
        counts.index_add_(0, local_ids, torch.ones_like(local_ids))
        ends = counts.cumsum(0).to(torch.int32)
        y = self.grouped_mlp(x.index_select(0, order), ends, experts)                     # [R, H] by expert
        return torch.empty_like(x).index_copy_(0, order, y)

    def _expert_loop(self, x: torch.Tensor, local_ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """:meth:`expert_rows` with one pair of GEMMs per non-empty expert (any dtype; syncs for the row counts)."""
        out = torch.empty_like(x)
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=experts.num_local).tolist()
        xs = x[order]
        outs = []
        start = 0
        for e, c in enumerate(counts):
            if c:
                h = self.silu_and_mul(F.linear(xs[start:start + c], experts.w13[e]))
                outs.append(F.linear(h, experts.w2[e]))
                start += c
        out[order] = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out

    def expert_segments(self, x: torch.Tensor, ends: torch.Tensor, expert_capacity: int,
                        experts: ExpertWeights) -> torch.Tensor:
        """:meth:`grouped_mlp` over the segments (they come sorted), so only the received rows are multiplied;
        without grouped GEMMs the rows are spread into the masked layout [E_local, expert_capacity, H]
        (:meth:`expert_masked`) and gathered back, all on the device."""
        experts = dense_experts(experts, x.dtype, self.weight_values)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if grouped_mm_ok(x):
            return self.grouped_mlp(x, ends, experts)                                     # [R_max, H]
        r, el, c = x.shape[0], experts.num_local, expert_capacity
        ends = ends.to(torch.int64)
        starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))                      # [E_local]
        slot = torch.arange(c, device=x.device)
        spread = (starts.view(el, 1) + slot.view(1, c)).clamp_(max=r - 1)               # [E_local, C]
        y = self.expert_masked(x.index_select(0, spread.view(-1)).view(el, c, -1), experts)
        pos = torch.arange(r, device=x.device)
        expert = torch.searchsorted(ends, pos, right=True).clamp_(max=el - 1)            # [R_max]
        return y.view(el * c, -1).index_select(0, expert * c + (pos - starts[expert]).clamp_(0, c - 1))

    def expert_masked(self, x: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Two batched GEMMs over all ``C`` rows of every expert, valid or not (a row's output depends on that
        row only, so invalid rows, which the combine never reads, cannot disturb valid ones); shapes depend on
        ``C`` only."""
        experts = dense_experts(experts, x.dtype, self.weight_values)
        h = self.silu_and_mul(torch.bmm(x, experts.w13.transpose(1, 2)))    # [E_local, C, I_local]
        return torch.bmm(h, experts.w2.transpose(1, 2))                 # [E_local, C, H]

    def expert_dense(self, x: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Two batched GEMMs ([E_local, R, 2 I] then [E_local, R, H]) and one weighted reduction over the experts
        in expert order; a row adds exact zeros for experts it did not pick. Worth it only where ``R * E_local`` is
        small: the other layouts multiply only routed rows."""
        experts = dense_experts(experts, x.dtype, self.weight_values)
        h = self.silu_and_mul(torch.matmul(x, experts.w13.transpose(1, 2)))     # [E_local, R, I_local]
        y = torch.bmm(h, experts.w2.transpose(1, 2))                        # [E_local, R, H]
        return (y * weights.t().unsqueeze(-1)).sum(dim=0)

    def expert_routed(self, rows: RoutedTokenRows, experts: ExpertWeights) -> torch.Tensor:
        """As the dense layout (:meth:`~raymoe.comm.expert_input.RoutedTokenRows.dense`)."""
        experts = dense_experts(experts, rows.x.dtype, self.weight_values)
        dense = rows.dense(experts.num_local)
        return self.expert_dense(dense.x, dense.weights, experts)

    def use_token_rows(self, ep_size: int, capacity: int, top_k: int, num_experts: int, expert_row_macs: int,
                       hidden: torch.Tensor) -> bool:
        """Never: the sorted pairs and grouped GEMMs cost the same whatever the step's size."""
        return False
