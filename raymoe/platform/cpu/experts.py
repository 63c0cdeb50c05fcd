"""The CPU platform's expert operations: the packed grouped GEMM (``kernels.packed_linear``) over expert segments at
small row counts, and the fused routed-experts kernel (``kernels.cpu_ops.moe_routed_rows``) for token rows, which
computes only each row's routed (row, expert) pairs, reading the routing itself. Calls the kernels cannot take run
the reference operations. FP8 experts take the reference path's weight-only dequantization (packing them would keep
a float32 copy resident, the memory FP8 saves); the routed-rows kernel then runs over the dequantized weights."""

from __future__ import annotations

import torch

from raymoe.comm.expert_input import ExpertWeights, RoutedTokenRows
from raymoe.platform.cpu import expert_layout
from raymoe.platform.cpu.kernels import cpu_ops, packed_linear
from raymoe.platform.reference.experts import ExpertOps
from raymoe.platform.reference.fp8 import dense_experts


class CpuExpertOps(ExpertOps):
    """Expert operations of a CPU rank (module docstring)."""

    def grouped_mlp(self, x: torch.Tensor, ends: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Both projections over the segments with the packed GEMM where it applies (``packed_linear.use_packed``:
        the experts were packed at load and rows x threads <= 128), else ``torch._grouped_mm``."""
        if packed_linear.use_packed(experts.prepared13, x):
            h = self.silu_and_mul(packed_linear.grouped_linear(x, ends, experts.prepared13))   # [R, I_local]
            return packed_linear.grouped_linear(h, ends, experts.prepared2)
        return super().grouped_mlp(x, ends, experts)

    def expert_routed(self, rows: RoutedTokenRows, experts: ExpertWeights) -> torch.Tensor:
        experts = dense_experts(experts, rows.x.dtype, self.weight_values)
        if cpu_ops.enabled_for(rows.x, rows.topk_weights, experts.w13, experts.w2):
            return cpu_ops.moe_routed_rows(rows.x, rows.topk_ids, rows.topk_weights, rows.first_expert, experts.w13,
                                           experts.w2)
        return super().expert_routed(rows, experts)

    def use_token_rows(self, ep_size: int, capacity: int, top_k: int, num_experts: int, expert_row_macs: int,
                       hidden: torch.Tensor) -> bool:
        """The cost model of ``raymoe.platform.cpu.expert_layout``."""
        return expert_layout.use_token_rows(ep_size, capacity, top_k, num_experts, expert_row_macs, hidden)
