"""Reference expert computations (SwiGLU experts, Shazeer 2020) over each layout a dispatch hands the local experts
(``raymoe.comm.expert_input``), in torch operators. The methods of :class:`ExpertOps` implement the expert part of
:class:`~raymoe.platform.interface.Platform`; shapes are in its docstrings.

Grouped GEMMs run over expert-sorted rows where the platform has them for the rows (:meth:`ExpertOps.grouped_ok`;
here ``torch._grouped_mm`` on CPU: float32, bfloat16, float16; not under ``torch.compile``, whose shape rule takes
bfloat16 only): one GEMM per projection whatever the number of experts with rows, shapes that depend on the row
count only, no host sync. Elsewhere rows run one GEMM pair per non-empty expert (a host sync for the counts), and
fixed-shape segments are spread into the masked layout, whose batched GEMMs multiply every slot.
FP8 experts (``prepared13`` holds their ``BlockScales``) are block-dequantized to the rows' dtype at the start of
each operation (``fp8.dense_experts``: weight-only, the FP8 weights stay resident).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from raymoe.comm.expert_input import ExpertWeights, MaskedExpertRows, RoutedTokenRows
from raymoe.platform.reference.fp8 import dense_experts

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes on CPU


def grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes rows ``x`` here: CPU, a dtype it takes, outside ``torch.compile``."""
    return (x.device.type == "cpu" and x.dtype in _GROUPED_MM_DTYPES and hasattr(torch, "_grouped_mm")
            and not torch.compiler.is_compiling())


class ExpertOps:
    """Torch implementations of the platform's expert operations."""

    def grouped_ok(self, x: torch.Tensor, experts: ExpertWeights) -> bool:
        """Whether :meth:`grouped_mlp` takes rows like ``x`` [R, H] with these experts here (without a host sync):
        :func:`grouped_mm_ok`. Platforms with their own grouped GEMM override both."""
        return grouped_mm_ok(x)

    def grouped_mlp(self, x: torch.Tensor, ends: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Both projections over expert segments (``ends`` [E_local] int32): ``x`` [R, H] -> [R, H] with
        ``torch._grouped_mm`` (callers check :meth:`grouped_ok`); rows from ``ends[-1]`` on are not multiplied and
        answer anything. Platforms with a faster grouped GEMM override it."""
        h = self.silu_and_mul(torch._grouped_mm(x, experts.w13.transpose(1, 2), offs=ends))    # [R, I_local]
        return torch._grouped_mm(h, experts.w2.transpose(1, 2), offs=ends)

    def expert_rows(self, x: torch.Tensor, local_ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Rows sorted by expert into segments, then :meth:`grouped_mlp` (no Python loop over experts, no host
        sync); without grouped GEMMs one pair of GEMMs per non-empty expert. Both give the same rows. Rows of
        ``NO_EXPERT`` (-1) sort after every segment, are never multiplied, and answer 0."""
        experts = dense_experts(experts, x.dtype, self.weight_values)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if not self.grouped_ok(x, experts):
            return self._expert_loop(x, local_ids, experts)
        return self.by_expert(x, local_ids, experts.num_local,
                              lambda rows, ends: self.grouped_mlp(rows, ends, experts))

    def by_expert(self, x: torch.Tensor, local_ids: torch.Tensor, num_local: int,
                  mlp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``mlp`` over ``x`` [R, H] sorted into expert segments (``mlp(rows, ends)``, ``ends`` [E_local] int32),
        answered in the rows' order; rows of ``NO_EXPERT`` sort after every segment and answer 0. No host sync."""
        key, order = torch.sort(local_ids.remainder(num_local + 1), stable=True)          # NO_EXPERT -> E_local
        ends = torch.searchsorted(key, self._expert_ids(num_local, key.device), right=True, out_int32=True)
        y = mlp(x.index_select(0, order), ends)                                           # [R, H] by expert
        out = torch.empty_like(x).index_copy_(0, order, y)
        return out.masked_fill_(local_ids.unsqueeze(1) < 0, 0)

    def _expert_ids(self, num_local: int, device: torch.device) -> torch.Tensor:
        """``arange(num_local)`` [E_local] int64 on ``device`` (kept per device and stream scope: a graph holds its
        address, and a second stream reads only constants made on it, ``Platform.stream_scope``)."""
        cache = vars(self).setdefault("_expert_id_cache", {})
        key = (num_local, device, self.stream_scope())
        ids = cache.get(key)
        if ids is None:
            ids = cache[key] = torch.arange(num_local, device=device)
        return ids

    def _expert_loop(self, x: torch.Tensor, local_ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """:meth:`expert_rows` with one pair of GEMMs per non-empty expert (any dtype; syncs for the row counts)."""
        el = experts.num_local
        key = local_ids.remainder(el + 1)                                                  # NO_EXPERT -> E_local
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=el + 1).tolist()[:el]
        valid = sum(counts)
        out = torch.empty_like(x) if valid == x.shape[0] else torch.zeros_like(x)
        if not valid:
            return out
        xs = x[order]
        outs = []
        start = 0
        for e, c in enumerate(counts):
            if c:
                h = self.silu_and_mul(F.linear(xs[start:start + c], experts.w13[e]))
                outs.append(F.linear(h, experts.w2[e]))
                start += c
        out[order[:start]] = torch.cat(outs) if len(outs) > 1 else outs[0]
        return out

    def expert_segments(self, x: torch.Tensor, ends: torch.Tensor, expert_capacity: int,
                        experts: ExpertWeights) -> torch.Tensor:
        """:meth:`grouped_mlp` over the segments (they come sorted), so only the received rows are multiplied;
        without grouped GEMMs the rows are spread into the masked layout [E_local, expert_capacity, H]
        (:meth:`expert_masked`) and gathered back, all on the device."""
        experts = dense_experts(experts, x.dtype, self.weight_values)
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if self.grouped_ok(x, experts):
            return self.grouped_mlp(x, ends, experts)                                     # [R_max, H]
        r, el, c = x.shape[0], experts.num_local, expert_capacity
        ends = ends.to(torch.int64)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        starts = ends - counts                                                            # [E_local]
        slot = torch.arange(c, device=x.device)
        spread = (starts.view(el, 1) + slot.view(1, c)).clamp_(max=r - 1)               # [E_local, C]
        masked = MaskedExpertRows(x.index_select(0, spread.view(-1)).view(el, c, -1), counts.to(torch.int32),
                                  max_rows=min(r, el * c))
        y = self.expert_masked(masked, experts)
        pos = torch.arange(r, device=x.device)
        expert = torch.searchsorted(ends, pos, right=True).clamp_(max=el - 1)            # [R_max]
        return y.view(el * c, -1).index_select(0, expert * c + (pos - starts[expert]).clamp_(0, c - 1))

    def expert_masked(self, rows: MaskedExpertRows, experts: ExpertWeights) -> torch.Tensor:
        """Two batched GEMMs over all ``C`` rows of every expert, valid or not (a row's output depends on that
        row only, so invalid rows, which the combine never reads, cannot disturb valid ones); shapes depend on
        ``C`` only, and the work on the slots, not on ``counts``. FP8 rows (``rows.x_scale``) are dequantized to
        bfloat16 first."""
        rows = rows.dequantized()
        experts = dense_experts(experts, rows.x.dtype, self.weight_values)
        h = self.silu_and_mul(torch.bmm(rows.x, experts.w13.transpose(1, 2)))   # [E_local, C, I_local]
        return torch.bmm(h, experts.w2.transpose(1, 2))                      # [E_local, C, H]

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
