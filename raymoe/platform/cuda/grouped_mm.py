"""The CUDA platform's grouped GEMM: ``torch._grouped_mm`` where it runs as one CUTLASS kernel.

torch 2.13 (``aten/src/ATen/native/cuda/GroupedBlas.cpp`` ``_grouped_mm_cuda``, ``GroupMM.cu``,
``GroupMMCommon.cuh``, ``native/GroupedMMUtils.h``; builds without ``_grouped_mm`` never take this path) runs
``_grouped_mm`` as one CUTLASS grouped GEMM (``bf16bf16_grouped_mm``) when both operands and the output are bfloat16
and the device's compute capability major is 9 or 10 (H100/H200, B200): the kernel reads the offsets on the device,
so a CUDA graph holds it. Anywhere else (float32 or float16 rows, other GPUs) it falls back to one ``mm`` per group
after ``offs.cpu()``: a host sync per call, which graph capture refuses. :class:`TorchGroupedMm` therefore offers
only the CUTLASS path.

The constraints of that path for the ragged-rows case the experts use (``mat_a`` 2-D, ``mat_b`` 3-D):

* ``mat_a`` [R, K], ``mat_b`` [G, K, N], both bfloat16 on one device; ``offs`` [G] int32, 1-D; no bias; G < 1024;
* in each operand's last two dims one stride is 1 and the other at least that dim's size and a multiple of 16
  bytes (8 elements), and the data pointer is 16-byte aligned;
* group ``g`` is rows ``[offs[g - 1], offs[g])`` of ``mat_a`` (``offs[-1]`` read as 0) times ``mat_b[g]``; nothing
  checks that the offsets are non-decreasing and at most R (the kernel would read out of bounds); rows from
  ``offs[G - 1]`` on are not written, and an empty group costs nothing;
* the output [R, N] has its row stride padded to 16 bytes.

CPU tests select this path through a strict double of the op (``tests/grouped_mm_double.py``) that checks every
rule above and counts the multiply-adds it issues.
"""

from __future__ import annotations

from typing import Protocol

import torch

_CUTLASS_MAJORS = (9, 10)  # compute capability majors of the bfloat16 CUTLASS grouped GEMM
_ALIGN_BYTES = 16


class GroupedGemm(Protocol):
    """A grouped GEMM over ragged rows (semantics and constraints: module docstring)."""

    def takes(self, dtype: torch.dtype, device: torch.device, b: torch.Tensor) -> bool:
        """Whether :meth:`__call__` runs contiguous rows [R, K] of ``dtype`` on ``device`` (16-byte aligned, as a
        fresh allocation is) against ``b`` [G, K, N] without a host sync."""

    def __call__(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``out[offs[g - 1]:offs[g]] = a[offs[g - 1]:offs[g]] @ b[g]``: ``a`` [R, K], ``b`` [G, K, N], ``offs`` [G]
        int32 -> [R, N]; rows from ``offs[G - 1]`` on hold anything."""


def strides_ok(t: torch.Tensor) -> bool:
    """The stride rule of the CUTLASS path for ``t``'s last two dims (module docstring), without the pointer."""
    if t.dim() < 2:
        return False
    align = _ALIGN_BYTES // t.element_size()
    rows, cols = t.shape[-2], t.shape[-1]
    s_rows, s_cols = t.stride(-2), t.stride(-1)
    if s_rows == 1 and s_cols >= max(1, rows):
        return s_cols % align == 0
    if s_cols == 1 and s_rows >= max(1, cols):
        return s_rows % align == 0
    return False


class TorchGroupedMm:
    """``torch._grouped_mm`` on its CUTLASS path only (module docstring)."""

    def __init__(self) -> None:
        self._majors: dict[torch.device, int] = {}

    def _major(self, device: torch.device) -> int:
        major = self._majors.get(device)
        if major is None:
            major = self._majors[device] = torch.cuda.get_device_capability(device)[0]
        return major

    def takes(self, dtype: torch.dtype, device: torch.device, b: torch.Tensor) -> bool:
        return (device.type == "cuda" and b.device == device and dtype == b.dtype == torch.bfloat16
                and hasattr(torch, "_grouped_mm") and b.dim() == 3 and b.shape[0] < 1024
                and (b.shape[1] * b.element_size()) % _ALIGN_BYTES == 0 and strides_ok(b)
                and self._major(device) in _CUTLASS_MAJORS)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=offs)
