"""The CPU platform's cost model for the expert layout of a low-latency step (``raymoe.comm.low_latency``): the
pairs sorted by expert with grouped GEMMs over the segments (``GroupedExpertRows``), or every gathered token row
once with its own routing (``RoutedTokenRows``: the fused kernel over the routed pairs only, or a dense weight
matrix and two batched GEMMs over every local expert and row without the kernel).

Token rows skip the sort and the per-segment GEMMs over one- or two-row segments, which dominate a small decode
step on CPU: on two CPU ranks of the tiny benchmark model (8 or 16 tokens per rank, 4 experts each) a decode step
took 0.2-0.5 ms less. Where the step grows, the grouped layout wins, by the bounds below. Only a rank's own expert
work depends on the choice, never a collective (every rank still exchanges the same messages).
"""

from __future__ import annotations

import torch

from raymoe.platform.cpu.kernels import cpu_ops

DENSE_EXPERT_MAC_BUDGET = 1 << 22
"""Multiply-accumulates one MoE layer's local experts may spend on the dense layout (every local expert over every
gathered row): 0.15-0.25 ms on one core of the benchmark machine (an AVX2 EPYC, where a [16, 128] x [128, 512]
float32 GEMM ran at about 60 GFLOP/s). Below it the dense GEMMs cost less than the sort and the per-segment grouped
GEMMs they replace (measured crossover on one rank with 8 experts: about 24 tokens, where the budget allows 21)."""

ROUTED_KERNEL_ROWS_PER_EXPERT = 24
"""Where the fused kernel takes the experts (float32), a step uses token rows while its routed pairs per local
expert, ``ep * M * k / E``, are at most this, whatever the MAC budget: the kernel's cost follows the routed pairs,
not every expert over every row. Measured on the benchmark machine (tiny model, 8 experts top-2, whole decode
steps): at 16 pairs per expert 12-15 % less CPU per step than the sort and grouped GEMMs (ep=2 at 32 tokens per
rank, ep=1 at 64), even at 32, grouped ahead at 64."""

ROUTED_KERNEL_MAX_MACS = 1 << 23
"""Most multiply-accumulates of a step's routed pairs (``ep * M * k * 3 * H * I_local``) for which token rows are
chosen on behalf of the fused kernel: it saves the sort and index operators of the grouped layout (tens of
microseconds), but its dot products run at a fraction of the packed GEMM's rate. At the tiny model's size (24.6 K
MACs per pair, 342 pairs allowed) the pair bound above decides; at hidden 1024 and I 512 (1.57 M MACs per pair)
the kernel took a two-batch-overlap half step of 32 tokens per rank in 69 ms against 52 ms for the grouped layout
over packed weights (``raymoe bench overlap``)."""

_TOKEN_ROW_DTYPES = (torch.float32, torch.bfloat16)  # float32 range: a 0-weighted expert output cannot overflow


def dense_row_experts(expert_row_macs: int, budget_macs: int = DENSE_EXPERT_MAC_BUDGET) -> int:
    """How many (row, local expert) products fit ``budget_macs``, for experts of ``expert_row_macs = 3 H I_local``
    multiply-accumulates per row (gate, up and down projections); 0 where the size is unknown (0)."""
    return budget_macs // expert_row_macs if expert_row_macs > 0 else 0


def use_token_rows(ep_size: int, capacity: int, top_k: int, num_experts: int, expert_row_macs: int,
                   hidden: torch.Tensor) -> bool:
    """Whether a step of per-rank capacity ``capacity`` tokens (like ``hidden``), top-``top_k`` of ``num_experts``
    experts over ``ep_size`` ranks, hands the experts token rows (module docstring): CPU float32/bfloat16 tokens,
    experts of known size, and either every local expert over every row within :data:`DENSE_EXPERT_MAC_BUDGET`, or
    the fused kernel taking the tokens with the routed pairs within :data:`ROUTED_KERNEL_ROWS_PER_EXPERT` per expert
    and :data:`ROUTED_KERNEL_MAX_MACS`."""
    bound = dense_row_experts(expert_row_macs)
    if hidden.device.type != "cpu" or hidden.dtype not in _TOKEN_ROW_DTYPES or bound <= 0:
        return False
    if ep_size * capacity * (num_experts // ep_size) <= bound:
        return True
    pairs = ep_size * capacity * top_k
    return (pairs <= ROUTED_KERNEL_ROWS_PER_EXPERT * num_experts and pairs * expert_row_macs <= ROUTED_KERNEL_MAX_MACS
            and cpu_ops.enabled_for(hidden))
