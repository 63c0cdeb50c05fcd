"""FP8 experts on CUDA through DeepGEMM's grouped FP8 GEMMs (``deep_gemm``), DeepSeek-V3's recipe (arXiv:2412.19437,
Sec. 3.3) as SGLang's and vLLM's DeepEP MoE paths run it.

An FP8 checkpoint's experts stay FP8 ([E_local, N, K] ``float8_e4m3fn`` with 128 x 128 block scales
[E_local, ceil(N / 128), ceil(K / 128)] float32, exactly the layout DeepGEMM's SM90 kernels read); activations are
quantized per token and group of 128 channels on the fly (``fp8_gemm.per_token_group_quant``), and each projection
is one grouped GEMM that writes bfloat16:

* the masked layout of DeepEP's low-latency dispatch ([E_local, C, H] rows, ``counts`` valid per expert):
  ``m_grouped_fp8_gemm_nt_masked`` computes only each expert's first ``counts[e]`` rows (:meth:`masked_mlp`);
* expert-sorted segments (normal-mode pairs, the torch low-latency dispatch): every expert's segment is moved to a
  128-row aligned start of a padded buffer whose ``m_indices`` names each row's expert (-1 on padding rows, which
  the kernel skips), ``m_grouped_fp8_gemm_nt_contiguous`` runs over it and the rows are read back
  (:meth:`contiguous_mlp`). The padded size depends on the row count only (``round_up(R, 128) + 128 * E_local``),
  so CUDA graphs capture it.

Where DeepGEMM is missing (no wheel, no CUDA toolkit at import, another GPU than SM90/SM100) or a call does not fit
(not bfloat16, not 128 x 128 blocks, a projection width that is not a multiple of 128), callers keep the weight-only
dequantization of the reference path. Nothing imports ``deep_gemm`` before the first FP8 call; CPU tests pass a
strict double of its API (``tests/deep_gemm_double.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from raymoe.comm.expert_input import ExpertWeights
from raymoe.platform.cuda.fp8_gemm import GROUP, per_token_group_quant
from raymoe.platform.interface import BlockScales

_MISSING = object()


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant`` over the last dim of ``x`` [..., K]: (fp8 [..., K], float32 [..., K / 128])."""
    q, s = per_token_group_quant(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), s.view(*x.shape[:-1], -1)


class DeepGemmExperts:
    """The grouped FP8 expert GEMMs of a CUDA rank (module docstring).

    Args:
        module: the ``deep_gemm`` module or a conformance double (None: imported on first use; where the import
            fails, :meth:`fits` is False).
    """

    def __init__(self, module: Any = None):
        self._module = module if module is not None else _MISSING
        self._contiguous: Callable | None = None
        self._masked: Callable | None = None
        self.alignment = GROUP

    def _lookup(self) -> bool:
        if self._module is _MISSING:
            try:
                import deep_gemm
            except (ImportError, AssertionError, OSError, RuntimeError):  # no wheel, no toolkit, no driver
                deep_gemm = None
            self._module = deep_gemm
        if self._module is None:
            return False
        if self._contiguous is None:
            dg = self._module
            self._contiguous = getattr(dg, "m_grouped_fp8_gemm_nt_contiguous", None)
            self._masked = getattr(dg, "m_grouped_fp8_gemm_nt_masked", None) or getattr(
                dg, "fp8_m_grouped_gemm_nt_masked", None)
            align = getattr(dg, "get_mk_alignment_for_contiguous_layout", None) or getattr(
                dg, "get_m_alignment_for_contiguous_layout", None)
            self.alignment = int(align()) if align is not None else GROUP
        return self._contiguous is not None and self._masked is not None

    def fits(self, dtype: torch.dtype, experts: ExpertWeights) -> bool:
        """Whether rows of ``dtype`` over ``experts`` take the FP8 GEMMs: bfloat16 rows, FP8 experts with
        128 x 128 block scales, ``H`` and the expert width multiples of 128, and DeepGEMM importable."""
        s13, s2 = experts.prepared13, experts.prepared2
        if not (isinstance(s13, BlockScales) and isinstance(s2, BlockScales)) or dtype != torch.bfloat16:
            return False
        if tuple(s13.block) != (GROUP, GROUP) or tuple(s2.block) != (GROUP, GROUP):
            return False
        if experts.w13.dtype != torch.float8_e4m3fn or not experts.w13.is_contiguous() or \
                not experts.w2.is_contiguous():
            return False
        h, inter = experts.w2.shape[1], experts.w2.shape[2]
        return h % GROUP == 0 and inter % GROUP == 0 and self._lookup()

    def masked_mlp(self, x: torch.Tensor, counts: torch.Tensor, expected_m: int, experts: ExpertWeights,
                   silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
                   x_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Both projections over the masked layout: ``x`` [E_local, C, H] bfloat16, ``counts`` [E_local] int32 ->
        [E_local, C, H] bfloat16, rows past ``counts[e]`` holding anything. ``expected_m``: the rows per expert
        the kernel should expect (a configuration hint, > 0). ``x_scale``: ``x`` is already FP8 with these
        per-token-group scales [E_local, C, H / 128] (DeepEP's FP8 dispatch), and is not quantized again."""
        el, c, _ = x.shape
        xq, sx = (x, x_scale) if x_scale is not None else _quant_rows(x)
        gate_up = torch.empty((el, c, experts.w13.shape[1]), dtype=torch.bfloat16, device=x.device)
        self._masked((xq, sx), (experts.w13, experts.prepared13.scale), gate_up, counts, expected_m)
        act = silu_and_mul(gate_up.view(el * c, -1)).view(el, c, -1)                  # [E_local, C, I]
        aq, sa = _quant_rows(act)
        out = torch.empty((el, c, experts.w2.shape[1]), dtype=torch.bfloat16, device=x.device)
        self._masked((aq, sa), (experts.w2, experts.prepared2.scale), out, counts, expected_m)
        return out

    def contiguous_mlp(self, x: torch.Tensor, ends: torch.Tensor, experts: ExpertWeights,
                       silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Both projections over expert segments: ``x`` [R, H] bfloat16 sorted by expert, ``ends`` [E_local] int32
        segment ends -> [R, H] bfloat16; rows from ``ends[-1]`` on are not multiplied and answer anything. No host
        sync."""
        r = x.shape[0]
        el, a = experts.num_local, self.alignment
        if r == 0:
            return torch.empty_like(x)
        padded_rows = -(-r // a) * a + el * a                                          # >= sum of aligned segments
        ends = ends.to(torch.int64)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        aligned = (counts + a - 1) // a * a
        aligned_starts = torch.cumsum(aligned, 0) - aligned                              # [E_local]
        j = torch.arange(r, device=x.device)
        expert = torch.searchsorted(ends, j, right=True)                                # E_local: past the last
        owner = expert.clamp(max=el - 1)
        valid = expert < el
        dst = torch.where(valid, aligned_starts[owner] + j - (ends - counts)[owner], padded_rows)  # [R]
        m_indices = torch.full((padded_rows + 1,), -1, dtype=torch.int32, device=x.device)
        m_indices.index_copy_(0, dst, torch.where(valid, owner, -1).to(torch.int32))
        xq, sx = per_token_group_quant(x)
        a_rows = xq.new_zeros((padded_rows + 1, x.shape[1]))                             # padding rows: zeros
        a_rows.view(torch.uint8).index_copy_(0, dst, xq.view(torch.uint8))              # (bytes: any FP8 build)
        a_scales = sx.new_zeros((padded_rows + 1, sx.shape[1]))
        a_scales.index_copy_(0, dst, sx)
        layout = m_indices[:padded_rows]
        gate_up = x.new_empty((padded_rows, experts.w13.shape[1]))
        self._contiguous((a_rows[:padded_rows], a_scales[:padded_rows]), (experts.w13, experts.prepared13.scale),
                         gate_up, layout)
        aq, sa = per_token_group_quant(silu_and_mul(gate_up))                            # [R_pad, I]
        out = x.new_empty((padded_rows, experts.w2.shape[1]))
        self._contiguous((aq, sa), (experts.w2, experts.prepared2.scale), out, layout)
        return out.index_select(0, dst.clamp(max=padded_rows - 1))
