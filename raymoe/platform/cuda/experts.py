"""The CUDA platform's expert operations: work proportional to the routed rows, in shapes a CUDA graph holds.

The reference operations on a GPU multiply more than the routed rows: the masked layout of DeepEP's low-latency
dispatch (``MaskedExpertRows``, [E_local, ep * M_max, H]) runs batched GEMMs over every slot (about E / k times
the routed rows' work for DeepSeek-V3 at ep = 16), and fixed-shape segments are spread into that layout. Where the
platform's grouped GEMM takes the rows (``grouped_mm.GroupedGemm``: ``torch._grouped_mm``'s CUTLASS path,
bfloat16 on compute capability 9.x/10.x), every layout runs one grouped GEMM per projection over its routed rows
only, reading the per-expert counts on the device:

* pair rows (normal mode, :class:`~raymoe.comm.expert_input.ExpertRows`) and sorted segments (the torch
  low-latency dispatch): as the reference, through :meth:`CudaExpertOps.grouped_mlp`;
* the masked layout: its valid rows are packed expert after expert into ``max_rows`` rows (the step's bound,
  ``ep * M * min(k, E_local)``), the grouped GEMMs run over the first ``sum(counts)`` of them, and the answers go
  back to their slots (:meth:`CudaExpertOps.expert_masked`), as SGLang's masked grouped GEMM (DeepGEMM
  ``m_grouped_*_gemm_nt_masked``) skips empty rows inside its kernel. The packing copies ``max_rows`` rows each way
  whatever the routing (fixed shapes), which costs memory traffic, not multiply-adds.

FP8 experts (an FP8 checkpoint's, kept FP8) take DeepGEMM's grouped FP8 GEMMs where they fit
(``deepgemm_experts.DeepGemmExperts``: masked for the masked layout, contiguous with 128-row aligned segments for
pair rows and segments); elsewhere they are dequantized per call (weight-only). Other dtypes and GPUs keep the
reference operations.
"""

from __future__ import annotations

import torch

from raymoe.comm.expert_input import ExpertWeights, MaskedExpertRows
from raymoe.platform.cuda.deepgemm_experts import DeepGemmExperts
from raymoe.platform.cuda.grouped_mm import GroupedGemm
from raymoe.platform.reference.experts import ExpertOps


class CudaExpertOps(ExpertOps):
    """Expert operations of a CUDA rank (module docstring).

    Attributes:
        grouped_gemm: the grouped GEMM (set by the platform: :class:`~raymoe.platform.cuda.grouped_mm.TorchGroupedMm`,
            or in tests a CPU double of it).
        fp8_experts: the grouped FP8 GEMMs of FP8 experts (set by the platform: over ``deep_gemm``, or in tests a
            CPU double of it).
    """

    grouped_gemm: GroupedGemm
    fp8_experts: DeepGemmExperts

    def expert_rows(self, x: torch.Tensor, local_ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """FP8 experts through the contiguous grouped FP8 GEMM where it fits, else the reference."""
        if x.shape[0] and self.fp8_experts.fits(x.dtype, experts):
            return self.by_expert(x, local_ids, experts.num_local, lambda rows, ends: self.fp8_experts.contiguous_mlp(
                rows, ends, experts, self.silu_and_mul))
        return super().expert_rows(x, local_ids, experts)

    def expert_segments(self, x: torch.Tensor, ends: torch.Tensor, expert_capacity: int,
                        experts: ExpertWeights) -> torch.Tensor:
        """FP8 experts through the contiguous grouped FP8 GEMM where it fits, else the reference."""
        if x.shape[0] and self.fp8_experts.fits(x.dtype, experts):
            return self.fp8_experts.contiguous_mlp(x, ends, experts, self.silu_and_mul)
        return super().expert_segments(x, ends, expert_capacity, experts)

    def grouped_ok(self, x: torch.Tensor, experts: ExpertWeights) -> bool:
        """Whether the grouped GEMM takes both projections over rows like ``x`` [R, H] (contiguous, 16-byte
        aligned) without a host sync."""
        gemm = self.grouped_gemm
        return (x.is_contiguous() and x.data_ptr() % 16 == 0
                and gemm.takes(x.dtype, x.device, experts.w13.transpose(1, 2))
                and gemm.takes(x.dtype, x.device, experts.w2.transpose(1, 2)))

    def grouped_mlp(self, x: torch.Tensor, ends: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Both projections over expert segments (``ends`` [E_local] int32) with the platform's grouped GEMM: ``x``
        [R, H] -> [R, H]; rows from ``ends[-1]`` on are not multiplied and answer anything."""
        gemm = self.grouped_gemm
        h = self.silu_and_mul(gemm(x, experts.w13.transpose(1, 2), ends))                   # [R, I_local]
        return gemm(h, experts.w2.transpose(1, 2), ends)

    def expert_masked(self, rows: MaskedExpertRows, experts: ExpertWeights) -> torch.Tensor:
        """The valid rows of the masked layout (``rows.x`` [E_local, C, H], ``rows.counts`` [E_local] int32) through
        :meth:`grouped_mlp`, packed into ``min(rows.max_rows, E_local * C)`` rows and answered in their slots
        ([E_local, C, H]; slots past ``counts[e]`` hold anything). No host sync; the reference's batched GEMMs over
        every slot where the grouped GEMM does not take the rows."""
        el, c, h = rows.x.shape
        packed_rows = min(rows.max_rows, el * c)
        fp8_rows = rows.x_scale is not None  # DeepEP's FP8 dispatch: FP8 rows with per-token-group scales
        if packed_rows and self.fp8_experts.fits(torch.bfloat16 if fp8_rows else rows.x.dtype, experts):
            expected_m = max(1, min(c, -(-packed_rows // el)))  # FP8 experts: DeepGEMM's masked kernel
            return self.fp8_experts.masked_mlp(rows.x, rows.counts, expected_m, experts, self.silu_and_mul,
                                               rows.x_scale)
        rows = rows.dequantized()
        x, counts = rows.x, rows.counts
        if packed_rows == 0 or not x.is_contiguous() or not self.grouped_ok(x.view(el * c, h), experts):
            return super().expert_masked(rows, experts)
        full_ends = counts.cumsum(0, dtype=torch.int32)                              # [E_local] packed segment ends
        starts = full_ends - counts
        # the kernel does not check its offsets: should counts ever pass the bound, it stops at the packed rows
        ends = full_ends.clamp(max=packed_rows)
        j = self._packed_positions(packed_rows, x.device)                            # [R] int32
        expert = torch.searchsorted(ends, j, right=True)                            # [R]; E_local: past the last
        owner = expert.clamp(max=el - 1)
        slot = owner * c + (j - starts.index_select(0, owner))                      # row j's slot in [E_local * C]
        valid = expert < el
        packed = x.view(el * c, h).index_select(0, torch.where(valid, slot, 0))     # rows past the last: not read
        y = self.grouped_mlp(packed, ends, experts)
        out = x.new_empty((el * c + 1, h))                                          # + one row for the rows past
        out.index_copy_(0, torch.where(valid, slot, el * c), y)
        return out[:el * c].view(el, c, h)

    def _packed_positions(self, rows: int, device: torch.device) -> torch.Tensor:
        """``arange(rows)`` int32 on ``device``, made once per size and stream scope (``Platform.stream_scope``)."""
        cache = vars(self).setdefault("_packed_position_cache", {})
        key = (rows, device, self.stream_scope())
        pos = cache.get(key)
        if pos is None:
            pos = cache[key] = torch.arange(rows, dtype=torch.int32, device=device)
        return pos
