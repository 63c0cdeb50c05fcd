"""A strict CPU double of ``torch._grouped_mm`` on its CUDA CUTLASS path, the grouped GEMM of the CUDA platform's
expert operations (``raymoe.platform.cuda.grouped_mm``), for the ragged-rows case they use (``mat_a`` [R, K] 2-D,
``mat_b`` [G, K, N] 3-D).

What it refuses is what torch 2.13's path refuses or cannot run without a host sync (``GroupedBlas.cpp``
``_grouped_mm_cuda``, ``GroupedMMUtils.h`` ``_grouped_mm_validate_inputs`` / ``check_valid_strides_and_return_
transposed``, ``GroupMM.cu``), written here from those sources rather than taken from the code under test:

* operands other than bfloat16 (the path is ``bf16bf16_grouped_mm``; float32/float16 fall back to ``offs.cpu()``
  and one ``mm`` per group: a host sync, which graph capture refuses), a bias, another output dtype;
* operands or offsets on different devices, a contraction dim that differs, 1024 groups or more;
* in either operand's last two dims, no unit stride, the other stride below that dim's size or not a multiple of
  16 bytes, or a data pointer not 16-byte aligned;
* offsets that are not a 1-D int32 tensor of one entry per group; offsets that decrease, start below 0 or pass R
  (the kernel does not check them and would read out of bounds: the double checks them on the "device", with
  ``torch._assert_async``, so a forward under ``HostSyncGuard`` still runs).

It computes each group's rows with torch's CPU ``_grouped_mm``, writes NaN into the rows from ``offs[-1]`` on (the
kernel leaves them unwritten), returns the output with the CUDA path's row stride (padded to 16 bytes), and counts
the FLOPs it issues, ``2 * offs[-1] * K * N`` per call, in a tensor (no host read inside a captured forward).
"""

from __future__ import annotations

import torch

ALIGN = 16  # bytes


class GroupedMmRefused(ValueError):
    """A call the CUDA CUTLASS path of ``torch._grouped_mm`` would refuse, or run only through its syncing fallback."""


def _need(ok: bool, why: str) -> None:
    if not ok:
        raise GroupedMmRefused(why)


def _check_operand(name: str, t: torch.Tensor) -> None:
    """``check_valid_strides_and_return_transposed`` with CUDA's pointer rule."""
    _need(t.data_ptr() % ALIGN == 0, f"{name}: expected data_ptr to be aligned to 16 bytes")
    align = ALIGN // t.element_size()
    rows, cols = t.shape[-2], t.shape[-1]
    s_rows, s_cols = t.stride(-2), t.stride(-1)
    if s_rows == 1 and s_cols >= max(1, rows):
        _need(s_cols % align == 0, f"{name}: strides should be multiple of 16 bytes, got {t.stride()}")
    elif s_cols == 1 and s_rows >= max(1, cols):
        _need(s_rows % align == 0, f"{name}: strides should be multiple of 16 bytes, got {t.stride()}")
    else:
        _need(False, f"{name}: invalid strides/sizes, got {t.stride()} for strides and {tuple(t.shape)} for sizes")


class StrictGroupedMm:
    """The double (module docstring); satisfies ``raymoe.platform.cuda.grouped_mm.GroupedGemm`` on CPU tensors.

    Attributes:
        flops: int64 scalar tensor, FLOPs issued so far (2 per multiply-add). calls: calls so far.
    """

    def __init__(self) -> None:
        self.flops = torch.zeros((), dtype=torch.int64)
        self.calls = 0

    def takes(self, dtype: torch.dtype, device: torch.device, b: torch.Tensor) -> bool:
        """The CUTLASS path's static rules for contiguous bfloat16 rows [R, K] on ``device`` against ``b``."""
        if not (device.type == "cpu" and b.device == device and dtype == b.dtype == torch.bfloat16 and b.dim() == 3
                and b.shape[0] < 1024 and (b.shape[1] * b.element_size()) % ALIGN == 0):
            return False
        try:
            _check_operand("mat_b", b)
        except GroupedMmRefused:
            return False
        return True

    def __call__(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``torch._grouped_mm(a, b, offs=offs)`` as the CUDA path computes it, or :class:`GroupedMmRefused`
        (``RuntimeError`` from ``torch._assert_async`` for offsets the kernel would misread)."""
        if a.dim() != 2 or b.dim() != 3:
            raise NotImplementedError("the double models mat_a 2-D x mat_b 3-D (ragged rows) only")
        _need(a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16,
              f"the CUTLASS path takes bfloat16 operands, got {a.dtype} and {b.dtype} (the fallback syncs on offs)")
        _need(out_dtype in (None, torch.bfloat16), "Grouped gemm output dtype must match `mat_a` dtype (bfloat16)")
        _need(bias is None, "Bias not supported yet")
        _need(a.device == b.device == offs.device, "mat_a, mat_b and offs must be on one device")
        _need(a.shape[1] == b.shape[1], "contraction dimension of mat_a and mat_b must match")
        _check_operand("mat_a", a)
        _check_operand("mat_b", b)
        _need(offs.dim() == 1, "offs has to be 1D")
        _need(offs.dtype == torch.int32, f"Offsets have to be int32, got {offs.dtype}")
        _need(offs.shape[0] == b.shape[0], "matrix batch sizes have to match")
        _need(b.shape[0] < 1024, "Can't process more than 1024 groups")
        r, k, n = a.shape[0], a.shape[1], b.shape[2]
        first = offs[:1]
        torch._assert_async((first >= 0).all() & (torch.diff(offs) >= 0).all(), "offsets must not decrease")
        torch._assert_async(offs[-1] <= r, "offsets must not pass the rows of mat_a")
        y = torch._grouped_mm(a, b, offs=offs)
        rows = torch.arange(r).unsqueeze(1)
        y = torch.where(rows < offs[-1], y, float("nan"))       # the kernel writes no row past the last group
        padded = -(-n * a.element_size() // ALIGN) * ALIGN // a.element_size()
        out = torch.empty_strided((r, n), (padded, 1), dtype=a.dtype).copy_(y)
        self.flops += 2 * offs[-1].to(torch.int64) * k * n
        self.calls += 1
        return out
