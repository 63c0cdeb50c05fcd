"""The CPU platform's expert operations: the packed grouped GEMM (``kernels.packed_linear``) over expert segments at
small row counts, and the fused routed-experts kernel (``kernels.cpu_ops.moe_routed_rows``) for token rows, which
computes only each row's routed (row, expert) pairs, reading the routing itself. Calls the kernels cannot take run
the reference operations. FP8 experts are dequantized per call, weight-only (packing them would keep a float32 copy
resident, the memory FP8 saves), and only the experts the call routes rows to (:func:`routed_experts`): a decode
step of a few tokens reaches a few of the experts, and dequantizing all of them cost most of an FP8 step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raymoe.comm.expert_input import ExpertWeights, RoutedTokenRows
from raymoe.platform.cpu import expert_layout
from raymoe.platform.cpu.kernels import cpu_ops, packed_linear
from raymoe.platform.interface import BlockScales
from raymoe.platform.reference.experts import ExpertOps
from raymoe.platform.reference.fp8 import DequantizedExperts, dense_experts


def routed_experts(experts: ExpertWeights, local_ids: torch.Tensor, dtype: torch.dtype,
                   values: Callable[[torch.Tensor, Any, torch.dtype], torch.Tensor]
                   ) -> tuple[ExpertWeights, torch.Tensor]:
    """FP8 ``experts`` dequantized only where ``local_ids`` (any shape, int64; values outside ``[0, E_local)``
    are another rank's experts or no expert) routes rows: ``U = min(E_local, local_ids.numel())`` experts, every
    routed one among them (then unrouted ones, in id order, to fill ``U``), as :class:`DequantizedExperts`
    [U, ...] in ``dtype`` (``values(weight, scales, dtype)`` dequantizes), and ``local_ids`` renumbered into them
    (the others -1). ``U`` depends on the call's shape only and nothing is read on the host, so decode graphs
    capture it (``raymoe.platform.reference.sync_guard``). Where ``U`` is every local expert, all are dequantized
    and ``local_ids`` is returned as given."""
    el = experts.num_local
    u = min(el, local_ids.numel())
    if u >= el:
        return dense_experts(experts, dtype, values), local_ids
    mine = (local_ids >= 0) & (local_ids < el)
    present = torch.zeros(el + 1, dtype=torch.int64).scatter_(0, torch.where(mine, local_ids, el).reshape(-1), 1)
    used = torch.argsort(present[:el], descending=True, stable=True)[:u]            # routed experts first
    s13, s2 = experts.prepared13, experts.prepared2
    w13 = values(experts.w13.index_select(0, used), BlockScales(s13.scale.index_select(0, used), s13.block), dtype)
    w2 = values(experts.w2.index_select(0, used), BlockScales(s2.scale.index_select(0, used), s2.block), dtype)
    lookup = torch.full((el,), -1, dtype=local_ids.dtype).scatter_(0, used, torch.arange(u, dtype=local_ids.dtype))
    renumbered = torch.where(mine, lookup[local_ids.clamp(0, el - 1)], -1)
    return DequantizedExperts(w13, w2, u, experts.expert_start), renumbered


class CpuExpertOps(ExpertOps):
    """Expert operations of a CPU rank (module docstring)."""

    def grouped_mlp(self, x: torch.Tensor, ends: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Both projections over the segments with the packed GEMM where it applies (``packed_linear.use_packed``:
        the experts were packed at load and rows x threads <= 128), else ``torch._grouped_mm``."""
        if packed_linear.use_packed(experts.prepared13, x):
            h = self.silu_and_mul(packed_linear.grouped_linear(x, ends, experts.prepared13))   # [R, I_local]
            return packed_linear.grouped_linear(h, ends, experts.prepared2)
        return super().grouped_mlp(x, ends, experts)

    def expert_rows(self, x: torch.Tensor, local_ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """As the reference; FP8 experts dequantized only where rows are routed (:func:`routed_experts`)."""
        if isinstance(experts.prepared13, BlockScales) and x.shape[0]:
            experts, local_ids = routed_experts(experts, local_ids, x.dtype, self.weight_values)
        return super().expert_rows(x, local_ids, experts)

    def expert_routed(self, rows: RoutedTokenRows, experts: ExpertWeights) -> torch.Tensor:
        """The routed-rows kernel where it takes the call, else the reference; FP8 experts dequantized only where
        rows are routed (:func:`routed_experts`)."""
        if isinstance(experts.prepared13, BlockScales):
            experts, ids = routed_experts(experts, rows.topk_ids - rows.first_expert, rows.x.dtype,
                                          self.weight_values)
            rows = RoutedTokenRows(rows.x, ids, rows.topk_weights, 0)
        if cpu_ops.enabled_for(rows.x, rows.topk_weights, experts.w13, experts.w2):
            return cpu_ops.moe_routed_rows(rows.x, rows.topk_ids, rows.topk_weights, rows.first_expert, experts.w13,
                                           experts.w2)
        return super().expert_routed(rows, experts)

    def use_token_rows(self, ep_size: int, capacity: int, top_k: int, num_experts: int, expert_row_macs: int,
                       hidden: torch.Tensor) -> bool:
        """The cost model of ``raymoe.platform.cpu.expert_layout``."""
        return expert_layout.use_token_rows(ep_size, capacity, top_k, num_experts, expert_row_macs, hidden)
