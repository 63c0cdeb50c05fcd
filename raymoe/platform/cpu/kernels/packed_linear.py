"""Linear layers of a CPU rank over weights packed once at load (``csrc/gemm.c``).

A decode step multiplies a few to a few dozen rows by each weight, which it reads cold from DRAM. MKL packs the
weight again on every call and only then computes; the packed kernel streams a pre-packed weight while its
FMAs run: on one thread of the CI machine, weights cold, [16, 128] x [128, 8192] took 0.38 against MKL's 1.04 ms
and [32, 1024] x [1024, 1024] 0.68 against 1.00 ms (1.1-3.0x over the sizes measured). It runs on one
thread, so it is only chosen where one thread is what MKL would get, or where the rows are few enough that MKL's
threads do not pay (:func:`use_packed`).

Owners (the linear layers, the LM head, the experts) call :func:`pack` after loading their weights and keep the
:class:`PackedWeight` beside the ``[out, in]`` weight, which other devices, dtypes and the torch paths still read;
so a CPU float32 rank holds those weights twice. An owner whose weight changes after load must pack again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raymoe.platform.cpu.kernels import cpu_ops

NR = 16                  # output columns per packed panel (NR in csrc/gemm.c)
MAX_ROWS_X_THREADS = 128  # rows x intra-op threads above which MKL's threaded GEMM wins (measured, see use_packed)


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight ``[G, N, K]`` (``G = 1`` for a plain linear layer) in the kernel's panel layout.

    Attributes:
        data: [G, ceil(N / 16), K, 16] float32 contiguous; panel ``b`` holds output columns ``16 b .. 16 b + 15``
            (zero past N).
        out_features: N. in_features: K. groups: G.
    """

    data: torch.Tensor
    out_features: int
    in_features: int
    groups: int

    def __post_init__(self) -> None:
        panels = -(-self.out_features // NR)
        if tuple(self.data.shape) != (self.groups, panels, self.in_features, NR):
            raise ValueError(f"packed data {tuple(self.data.shape)} does not hold [{self.groups}, {panels}, "
                             f"{self.in_features}, {NR}]")
        if self.data.dtype is not torch.float32 or not self.data.is_contiguous() or not self.data.is_cpu:
            raise ValueError("packed data must be a contiguous float32 CPU tensor")


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """Pack ``weight`` [N, K] or [G, N, K] (float32, CPU, any strides); ``None`` when the kernels cannot take it
    (another dtype or device, or the library is off), so the owner keeps its torch path.

    Raises:
        ValueError: a weight of fewer than 2 or more than 3 dims.
    """
    if weight.dim() not in (2, 3):
        raise ValueError(f"pack takes an [N, K] or [G, N, K] weight, got {tuple(weight.shape)}")
    if not cpu_ops.enabled_for(weight):
        return None
    w = weight.detach() if weight.dim() == 3 else weight.detach().unsqueeze(0)
    if w.stride(-1) != 1:
        w = w.contiguous()
    g, n, k = w.shape
    data = torch.empty((g, -(-n // NR), k, NR), dtype=torch.float32)
    lib = cpu_ops.lib()
    for i in range(g):
        lib.raymoe_pack_f32(w[i].data_ptr(), w[i].stride(0), n, k, data[i].data_ptr())
    return PackedWeight(data, n, k, g)


def repack_groups(packed: PackedWeight, weight: torch.Tensor, groups: Sequence[int]) -> None:
    """Pack groups ``groups`` of ``weight`` [G, N, K] again into ``packed`` (made by :func:`pack` from a weight of
    the same shape), in place: what an expert rebalance that rewrote those slots needs.

    Raises:
        ValueError: ``weight`` does not have ``packed``'s shape, or a group index is out of range.
    """
    g, n, k = weight.shape
    if (g, n, k) != (packed.groups, packed.out_features, packed.in_features):
        raise ValueError(f"repack_groups: weight {tuple(weight.shape)} does not match the packed "
                         f"[{packed.groups}, {packed.out_features}, {packed.in_features}]")
    w = weight.detach()
    lib = cpu_ops.lib()
    for i in groups:
        if not 0 <= i < g:
            raise ValueError(f"repack_groups: group {i} outside [0, {g})")
        src = w[i] if w[i].stride(-1) == 1 else w[i].contiguous()
        lib.raymoe_pack_f32(src.data_ptr(), src.stride(0), n, k, packed.data[i].data_ptr())


def use_packed(packed: PackedWeight | None, x: torch.Tensor) -> bool:
    """Whether ``x`` [..., K] (R rows in all) goes through ``packed``: it exists, ``x`` is float32 on the CPU,
    outside ``torch.compile`` tracing, and ``R x torch.get_num_threads() <= 128``.

    The row bound is measured on the CI machine (2 cores): one-threaded, the kernel beat MKL at every size up to
    R = 128; against MKL on 2 threads it wins up to R = 64 at [R, 1024] x [1024, 1024] (tie at 64) and loses at
    R = 256 (4.96 against 3.63 ms).
    """
    if packed is None or x.dtype is not torch.float32 or not x.is_cpu or x.shape[-1] == 0:
        return False
    rows = x.numel() // x.shape[-1]
    return rows * torch.get_num_threads() <= MAX_ROWS_X_THREADS and not torch.compiler.is_compiling()


def matmul(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed copy of ``weight`` where :func:`use_packed` says so:
    ``x`` [..., K], ``weight`` [N, K] -> [..., N]."""
    if use_packed(packed, x):
        return linear(x, packed, bias)
    return torch.nn.functional.linear(x, weight, bias)


def _rows_view(x: torch.Tensor, k: int) -> torch.Tensor:
    cpu_ops.need(x.shape[-1] == k, lambda: f"x has {x.shape[-1]} input features, the weight {k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 and x2.stride(0) >= k else x2.contiguous()


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)``: ``x`` [..., K] float32 CPU -> [..., N] float32 contiguous, ``W`` the packed
    [N, K] weight (``groups == 1``).

    Raises:
        ValueError: K does not match, or the weight is grouped.
    """
    cpu_ops.need(packed.groups == 1, "linear takes an ungrouped packed weight")
    k, n = packed.in_features, packed.out_features
    x2 = _rows_view(x, k)
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    cpu_ops.lib().raymoe_linear_packed_f32(x2.data_ptr(), x2.stride(0), x2.shape[0], packed.data.data_ptr(), n, k,
                                           y.data_ptr(), n)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], n)


def grouped_linear(x: torch.Tensor, ends: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """Weight ``g`` on rows ``[ends[g - 1], ends[g])`` of ``x`` [R, K] (``ends`` [G] int32, as
    ``torch._grouped_mm``'s ``offs``) -> [R, N]; rows from ``ends[-1]`` on are zero.

    Raises:
        ValueError: shapes or dtypes the kernel cannot take, or ``ends`` decreasing or past R.
    """
    k, n, g = packed.in_features, packed.out_features, packed.groups
    cpu_ops.need(x.dim() == 2, "x must be [R, K]")
    cpu_ops.need(ends.dtype is torch.int32 and ends.is_cpu and tuple(ends.shape) == (g,) and ends.is_contiguous(),
                 lambda: f"ends must be a contiguous [{g}] int32 CPU tensor")
    x2 = _rows_view(x, k)
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    data = packed.data
    rc = cpu_ops.lib().raymoe_grouped_linear_packed_f32(x2.data_ptr(), x2.stride(0), x2.shape[0], ends.data_ptr(), g,
                                                        data.data_ptr(), data[0].numel(), n, k, y.data_ptr(), n)
    cpu_ops.need(rc == 0, "ends must be non-decreasing and at most the row count")
    return y


class PackedWeightsMixin:
    """For an ``nn.Module`` that keeps packed copies of some of its weights: :data:`PACKED` names the pairs
    ``(packed attribute, weight attribute)``; :meth:`repack` packs them (after a load), and a device or dtype
    change (``Module._apply``: ``.to``, ``.float`` ...) packs again whatever was packed, or drops it where the
    weight is no longer a float32 CPU tensor."""

    PACKED: tuple[tuple[str, str], ...] = (("packed", "weight"),)

    def repack(self) -> None:
        """Pack every weight named in :data:`PACKED` (``None`` where the kernels cannot take it)."""
        for packed_name, weight_name in self.PACKED:
            setattr(self, packed_name, pack(getattr(self, weight_name)))

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        if any(getattr(self, name, None) is not None for name, _ in self.PACKED):
            self.repack()
        return out
