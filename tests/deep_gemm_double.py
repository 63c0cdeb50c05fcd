"""A strict CPU double of DeepGEMM's grouped FP8 GEMMs for MoE experts (``deep_gemm``, v2 API), as the SM90 build
checks and computes them (``csrc/apis/gemm.hpp``: ``m_grouped_fp8_fp4_gemm_nt_contiguous`` /
``m_grouped_fp8_fp4_gemm_nt_masked`` and their ``m_grouped_fp8_gemm_nt_*`` / ``fp8_m_grouped_gemm_nt_masked``
aliases; ``csrc/utils/layout.hpp``; the kernels' ``is_computation_valid``).

What the real library rejects, this raises (``RuntimeError("Assertion error ...")``, as ``DG_HOST_ASSERT`` does):
operands that are not ``float8_e4m3fn`` or not K-major (unit last stride; a 3-D weight also with
``stride(0) == N * K``), scale factors that are not float32 of shape ``[M, ceil(K / 128)]`` (A, per token and
group of 128) and ``[G, ceil(N / 128), ceil(K / 128)]`` (B, 128 x 128 blocks, contiguous or contiguous after
transposing its last two dims), an output that is not bfloat16 with a unit last stride, a layout that is not a
contiguous int32 ``[M]`` (contiguous) or ``[G]`` (masked) tensor, mismatched shapes, ``expected_m <= 0`` or
``m == 0`` in the masked call. Beyond the host asserts, the double also refuses what the kernel would compute
wrongly without telling: a 128-row block of the contiguous layout whose rows name more than one expert (the
kernel takes the expert of each block from its first row), or whose first row is -1 while later rows name an
expert (the kernel skips the whole block).

Rows it does not compute (contiguous: -1 rows; masked: rows from ``masked_m[g]`` on) are written NaN, so a caller
that reads them fails the parity tests. The arithmetic is the reference semantics in float32: ``a[m, k] *
sfa[m, k // 128]`` times ``b[g, n, k] * sfb[g, n // 128, k // 128]``, summed over ``k``, written bfloat16.
"""

from __future__ import annotations

import torch

ALIGNMENT = 128
"""``get_mk_alignment_for_contiguous_layout()`` of the real library (its legacy default, BLOCK_M on SM90)."""
_G = 128


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"Assertion error (deep_gemm double): {what}")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check_a(a: torch.Tensor, sfa: torch.Tensor, dims: int) -> None:
    _check(a.dim() == dims, f"a.dim() == {dims}")
    _check(a.dtype == torch.float8_e4m3fn, "a is float8_e4m3fn")
    _check(a.stride(-1) == 1, "major_a == K")
    if dims == 3:
        _check(a.stride(0) == a.shape[-2] * a.shape[-1], "a.stride(0) == m * k")
    _check(sfa.dtype == torch.float32, "sfa is float32 (SM90 recipe 1x128)")
    _check(tuple(sfa.shape) == (*a.shape[:-1], _ceil(a.shape[-1], _G)), "sfa is [.., m, ceil(k / 128)]")


def _check_b(b: torch.Tensor, sfb: torch.Tensor) -> None:
    _check(b.dim() == 3, "b.dim() == 3")
    _check(b.dtype == torch.float8_e4m3fn, "b is float8_e4m3fn")
    _check(b.stride(-1) == 1 and b.stride(0) == b.shape[1] * b.shape[2], "major_b == K (fp8_requires_k_major)")
    g, n, k = b.shape
    _check(sfb.dtype == torch.float32, "sfb is float32 (SM90 recipe 128x128)")
    _check(tuple(sfb.shape) == (g, _ceil(n, _G), _ceil(k, _G)), "sfb is [g, ceil(n / 128), ceil(k / 128)]")
    _check(sfb.is_contiguous() or sfb.transpose(-1, -2).is_contiguous(), "sm90_sfb_check: contiguous sfb")


def _dequant_a(a: torch.Tensor, sfa: torch.Tensor) -> torch.Tensor:
    k = a.shape[-1]
    return a.float() * sfa.repeat_interleave(_G, dim=-1)[..., :k]


def _dequant_b(b: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
    n, k = b.shape[-2:]
    s = sfb.repeat_interleave(_G, dim=-2)[..., :n, :].repeat_interleave(_G, dim=-1)[..., :k]
    return b.float() * s


def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, grouped_layout: torch.Tensor, recipe=None,
                                     recipe_a=None, recipe_b=None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False, use_psum_layout: bool = False,
                                     ensure_zero_padding: bool = True, expected_m_for_psum_layout=None) -> None:
    """``d[m] = a[m] @ b[grouped_layout[m]].T`` for rows whose expert is >= 0 (module docstring)."""
    (a, sfa), (b, sfb) = a, b
    _check(not use_psum_layout and expected_m_for_psum_layout is None, "the double models the non-psum layout")
    _check(grouped_layout.is_contiguous(), "grouped_layout.is_contiguous()")
    _check_a(a, sfa, 2)
    _check_b(b, sfb)
    m, k = a.shape
    g, n, k_ = b.shape
    _check(d.dim() == 2 and tuple(d.shape) == (m, n) and k == k_, "m == m_ and n == n_ and k == k_")
    _check(n > 0 and k > 0 and g > 0, "n > 0 and k > 0 and num_groups > 0")
    _check(d.dtype == torch.bfloat16, "d.scalar_type() == torch::kBFloat16")
    _check(grouped_layout.dtype == torch.int32 and tuple(grouped_layout.shape) == (m,), "grouped_layout is int32 [m]")
    _check(d.stride(-1) == 1, "check_major_type_cd(d)")
    if m == 0:
        return
    layout = grouped_layout.long()
    _check(bool((layout < g).all()) and bool((layout >= -1).all()), "grouped_layout in [-1, num_groups)")
    pad = (-m) % ALIGNMENT
    blocks = torch.cat([layout, layout.new_full((pad,), -1)]).view(-1, ALIGNMENT)
    first = blocks[:, :1]
    _check(bool(((blocks == first) | (blocks == -1)).all()), "one expert per 128-row block (the kernel reads the "
                                                             "block's first row)")
    _check(bool(((first >= 0) | (blocks == -1)).all()), "a block whose first row is -1 is skipped whole")
    x = _dequant_a(a, sfa)
    w = _dequant_b(b, sfb)
    out = torch.full((m, n), float("nan"))
    for e in layout.unique().tolist():
        if e >= 0:
            rows = (layout == e).nonzero().squeeze(1)
            out[rows] = x[rows] @ w[e].t()
    d.copy_(out.to(torch.bfloat16))


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, recipe=None,
                                 recipe_a=None, recipe_b=None, compiled_dims: str = "nk",
                                 disable_ue8m0_cast: bool = False) -> None:
    """``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T`` (module docstring)."""
    (a, sfa), (b, sfb) = a, b
    _check(masked_m.is_contiguous(), "masked_m.is_contiguous()")
    _check_a(a, sfa, 3)
    _check_b(b, sfb)
    g, m, k = a.shape
    g_, n, k_ = b.shape
    _check(d.dim() == 3 and g == g_ == d.shape[0] == masked_m.numel(), "num_groups agree")
    _check(tuple(d.shape[1:]) == (m, n) and k == k_, "m == m_ and n == n_ and k == k_")
    _check(expected_m > 0 and m > 0 and n > 0 and k > 0 and g > 0,
           "expected_m > 0 and m > 0 and n > 0 and k > 0 and num_groups > 0")
    _check(d.dtype == torch.bfloat16, "d.scalar_type() == torch::kBFloat16")
    _check(masked_m.dtype == torch.int32, "masked_m.scalar_type() == torch::kInt")
    _check(d.stride(-1) == 1, "check_major_type_cd(d)")
    x = _dequant_a(a, sfa)
    w = _dequant_b(b, sfb)
    out = torch.full((g, m, n), float("nan"))
    for e, count in enumerate(masked_m.tolist()):
        count = min(max(count, 0), m)
        out[e, :count] = x[e, :count] @ w[e].t()
    d.copy_(out.to(torch.bfloat16))


def get_mk_alignment_for_contiguous_layout() -> int:
    """The row alignment of each expert's segment in the contiguous layout."""
    return ALIGNMENT


# The names the library exports for the same entry points.
m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_fp4_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
