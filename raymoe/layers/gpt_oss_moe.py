"""gpt-oss's MoE block: a router with a bias, experts with biases and the clamped SwiGLU (``GptOssArch``).

Routing: ``logits = x W_r^T + b_r``; the top-k logits' softmax weighs the chosen experts (transformers'
``GptOssTopKRouter``), which equals the softmax over all experts renormalized over the top-k, so the block routes
with the ordinary softmax greedy rule (``RouterConfig(norm_topk_prob=True)``) after the biased gate.

Experts (transformers' ``GptOssExperts``): ``gate_up = x W_gu + b_gu`` with gate and up interleaved (even / odd
columns of the checkpoint's ``gate_up_proj`` [E, H, 2 I]); ``h = (clamp(up, -l, l) + 1) * g * sigmoid(alpha g)``
with ``g = min(gate, l)``; ``y = h W_d + b_d`` (``down_proj`` [E, I, H]). At load the gate and up columns are
de-interleaved into raymoe's ``w13`` [E_local, 2 I_local, H] layout (gate rows, then up rows) so tensor parallelism
splits ``I`` as for every other family; the down bias is added on TP rank 0 only (the partial sums are all-reduced).

The arithmetic is :class:`ClampedSwigluExperts`, torch operators over every layout a dispatch hands the experts
(``raymoe.comm.expert_input``); no platform kernel covers biases and the clamp (the platforms' expert operations
are plain SwiGLU), so this block never calls them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raymoe.comm.dispatcher import A2ABackendSpec
from raymoe.comm.expert_input import ExpertCompute, ExpertInput, RoutedTokenRows
from raymoe.comm.groups import ParallelGroups
from raymoe.config_arch import GptOssArch, RouterConfig
from raymoe.errors import CheckpointError
from raymoe.layers.linear import ReplicatedLinear
from raymoe.layers.moe import LocalExperts, SparseMoeBlock
from raymoe.platform.interface import Platform


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: ``h`` [..., 2 I] (gate then up halves) -> [..., I] (module docstring)."""
    inter = h.shape[-1] // 2
    gate = h[..., :inter].clamp(max=limit)
    up = h[..., inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwigluExperts(ExpertCompute):
    """The expert operations of biased clamped-SwiGLU experts (:class:`GptOssExperts`), in torch operators.

    ``expert_rows`` runs one GEMM pair per expert with rows (a host sync for the counts); the fixed-shape layouts
    (``expert_masked``, ``expert_segments``, ``expert_dense``) run every local expert over every row they are
    given, so they capture in decode graphs: worth it for the few rows of a decode step only.
    """

    def __init__(self, arch: GptOssArch):
        self.alpha, self.limit = arch.swiglu_alpha, arch.swiglu_limit

    def _batched(self, x: torch.Tensor, experts) -> torch.Tensor:
        """Every local expert over its own rows: ``x`` [E_local, C, H] -> [E_local, C, H]."""
        h = torch.baddbmm(experts.b13.unsqueeze(1), x, experts.w13.transpose(1, 2))
        return torch.baddbmm(experts.b2.unsqueeze(1), clamped_swiglu(h, self.alpha, self.limit),
                             experts.w2.transpose(1, 2))

    def expert_rows(self, x, local_ids, experts):
        """Rows of ``NO_EXPERT`` (-1: a graph's padding rows) sort last, are not multiplied and answer 0."""
        el = experts.num_local
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        key = local_ids.remainder(el + 1)                                                  # NO_EXPERT -> E_local
        counts = torch.bincount(key, minlength=el + 1).tolist()[:el]
        order = torch.argsort(key, stable=True)
        xs, start, outs = x[order], 0, []
        for e, c in enumerate(counts):
            if c:
                h = F.linear(xs[start:start + c], experts.w13[e], experts.b13[e])
                outs.append(F.linear(clamped_swiglu(h, self.alpha, self.limit), experts.w2[e], experts.b2[e]))
                start += c
        if outs:
            out[order[:start]] = torch.cat(outs)
        return out

    def expert_masked(self, rows, experts):
        return self._batched(rows.x, experts)

    def expert_segments(self, x, ends, expert_capacity, experts):
        if x.shape[0] == 0:
            return torch.empty_like(x)
        y = self._batched(x.unsqueeze(0).expand(experts.num_local, -1, -1), experts)       # [E_local, R_max, H]
        pos = torch.arange(x.shape[0], device=x.device)
        expert = torch.searchsorted(ends.to(torch.int64), pos, right=True).clamp_(max=experts.num_local - 1)
        return y[expert, pos]

    def expert_dense(self, x, weights, experts):
        y = self._batched(x.unsqueeze(0).expand(experts.num_local, -1, -1), experts)       # [E_local, R, H]
        return (y * weights.t().unsqueeze(-1).to(y.dtype)).sum(dim=0)

    def expert_routed(self, rows: RoutedTokenRows, experts):
        dense = rows.dense(experts.num_local)
        return self.expert_dense(dense.x, dense.weights, experts)


class GptOssExperts(LocalExperts):
    """The local experts with biases: ``w13`` [E_local, 2 I_local, H], ``b13`` [E_local, 2 I_local], ``w2``
    [E_local, H, I_local], ``b2`` [E_local, H] (zero on TP ranks other than 0 when ``I`` is split)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, groups: ParallelGroups,
                 dtype: torch.dtype, ops: Platform, arch: GptOssArch):
        super().__init__(num_experts, hidden_size, intermediate_size, groups, dtype, ops)
        self.b13 = torch.nn.Parameter(torch.zeros(self.num_local, 2 * self.inter_local, dtype=dtype),
                                      requires_grad=False)
        self.b2 = torch.nn.Parameter(torch.zeros(self.num_local, hidden_size, dtype=dtype), requires_grad=False)
        self.compute = ClampedSwigluExperts(arch)

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        return self.compute.expert_rows(x, local_ids, self)

    def forward_input(self, rows: ExpertInput) -> torch.Tensor:
        return rows.compute(self.compute, self)

    def _read(self, reader, name: str, expect: tuple[int, ...]) -> torch.Tensor:
        e0, e1 = self.expert_start, self.expert_start + self.num_local
        t = reader.get_slice(name, 0, e0, e1, dtype=self.w13.dtype)
        if tuple(t.shape[1:]) != expect:
            raise CheckpointError(name, f"unexpected shape {tuple(t.shape)} (experts x {expect})")
        return t

    def load(self, reader, prefix: str) -> None:
        """Read ``{prefix}.gate_up_proj`` [E, H, 2 I], ``gate_up_proj_bias`` [E, 2 I], ``down_proj`` [E, I, H] and
        ``down_proj_bias`` [E, H] for the local experts (MXFP4 checkpoints through ``raymoe.models.mxfp4``).

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape.
        """
        h, il, tp = self.w13.shape[2], self.inter_local, self.tp_split
        inter = il * tp
        i0 = self.groups.tp_rank * il if tp > 1 else 0
        gu = self._read(reader, f"{prefix}.gate_up_proj", (h, 2 * inter))
        gu_b = self._read(reader, f"{prefix}.gate_up_proj_bias", (2 * inter,))
        down = self._read(reader, f"{prefix}.down_proj", (inter, h))
        down_b = self._read(reader, f"{prefix}.down_proj_bias", (h,))
        self.w13.data.copy_(torch.cat([gu[..., 0::2][..., i0:i0 + il], gu[..., 1::2][..., i0:i0 + il]], dim=-1)
                            .transpose(1, 2))
        self.b13.data.copy_(torch.cat([gu_b[:, 0::2][:, i0:i0 + il], gu_b[:, 1::2][:, i0:i0 + il]], dim=-1))
        self.w2.data.copy_(down[:, i0:i0 + il].transpose(1, 2))
        self.b2.data.copy_(down_b if tp == 1 or self.groups.tp_rank == 0 else torch.zeros_like(down_b))


class GptOssMoeBlock(SparseMoeBlock):
    """:class:`~raymoe.layers.moe.SparseMoeBlock` with a biased router (``router.weight`` / ``router.bias``) and
    :class:`GptOssExperts`; the same op list. Arguments as the base's, plus ``arch`` (the SwiGLU constants)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 groups: ParallelGroups, dtype: torch.dtype, ops: Platform, a2a_backend: str | A2ABackendSpec,
                 arch: GptOssArch):
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, True, groups, dtype, ops, a2a_backend,
                         router=RouterConfig(norm_topk_prob=True))
        self.gate = ReplicatedLinear(hidden_size, num_experts, dtype, ops, bias=True)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, groups, dtype, ops, arch)

    def load(self, reader, prefix: str) -> None:
        self.gate.load(reader, f"{prefix}.router.weight")
        self.experts.load(reader, f"{prefix}.experts")
