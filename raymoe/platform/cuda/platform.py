"""CudaPlatform: the :class:`~raymoe.platform.interface.Platform` of a rank that computes on a CUDA GPU.

The reference operations run as CUDA kernels through torch; this platform adds decode capture as CUDA graphs
(``graphs.py``), SGLang's fine-grained DECODE two-batch-overlap schedule, and block-scaled FP8 GEMMs for FP8
checkpoints (``fp8_gemm.py``: per-token-group activation quantization and torch's block-scaled ``scaled_mm``; weights
outside what that kernel takes, and the experts' grouped GEMMs, run the reference block dequantization). The GPU
libraries' adapters, flash-attention (``flash_attn.py``, ``flash_attn_provider.py``) and DeepEP (``deepep.py``,
``deepep_buffer.py``), are registered by the selector (``raymoe.platform.selector``) for every platform, since CPU
tests run them through conformance doubles of their libraries. A GPU kernel touches only this package.
"""

from __future__ import annotations

from typing import Any

import torch

from raymoe.platform.cuda.fp8_gemm import BlockFp8Gemm
from raymoe.platform.cuda.graphs import CudaGraphCapture
from raymoe.platform.interface import BackendRegistry, BlockScales, GraphCapture, WeightKind
from raymoe.platform.reference.platform import TorchPlatform


class CudaPlatform(TorchPlatform):
    """The CUDA platform (module docstring).

    Args:
        backends: see :class:`~raymoe.platform.reference.platform.TorchPlatform`.
        fp8_gemm: the block-scaled FP8 linear (None: :class:`~raymoe.platform.cuda.fp8_gemm.BlockFp8Gemm` over
            torch's ``scaled_mm``; tests pass one over a conformance double).
    """

    name = "cuda"
    default_tbo_decode_schedule = "fine"
    fixed_shape_decode = True

    def __init__(self, backends: BackendRegistry | None = None, fp8_gemm: BlockFp8Gemm | None = None):
        super().__init__(backends)
        self.fp8_gemm = fp8_gemm or BlockFp8Gemm()

    def prepare_weight(self, weight: torch.Tensor, kind: WeightKind, scales: BlockScales | None = None) -> Any:
        """An FP8 linear weight's scales, also in the layout the FP8 GEMM reads (``BlockFp8Gemm.prepare``);
        otherwise as the reference."""
        prepared = super().prepare_weight(weight, kind, scales)
        if scales is not None and kind is WeightKind.LINEAR:
            return self.fp8_gemm.prepare(weight, scales)
        return prepared

    def linear(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """The block-scaled FP8 GEMM where it takes the call, else the reference (weight-only dequantization for
        FP8 weights)."""
        if isinstance(prepared, BlockScales) and self.fp8_gemm.fits(x, prepared):
            return self.fp8_gemm(x, weight, prepared, bias)
        return super().linear(x, weight, prepared, bias)

    def graph_capture(self, device: torch.device) -> GraphCapture:
        return CudaGraphCapture(device)
