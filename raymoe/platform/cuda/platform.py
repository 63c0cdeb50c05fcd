"""CudaPlatform: the :class:`~raymoe.platform.interface.Platform` of a rank that computes on a CUDA GPU.

The reference operations run as CUDA kernels through torch; this platform adds expert GEMMs over the routed rows
only, in fixed shapes (``experts.py`` over ``grouped_mm.py``: ``torch._grouped_mm``'s CUTLASS path), decode capture
as CUDA graphs (``graphs.py``), SGLang's fine-grained DECODE two-batch-overlap schedule, the step's token copy to the
host behind an event and the second stream of two-batch overlap (``streams.py``), and block-scaled FP8 GEMMs for FP8
checkpoints (``fp8_gemm.py``: per-token-group activation quantization and torch's block-scaled ``scaled_mm``; weights
outside what that kernel takes, and FP8 experts, run the reference block dequantization). The GPU libraries'
adapters, flash-attention (``flash_attn.py``, ``flash_attn_provider.py``), FlashInfer's paged MLA
(``flashinfer_mla.py``, ``flashinfer_mla_provider.py``) and DeepEP (``deepep.py``, ``deepep_buffer.py``), are
registered by the selector (``raymoe.platform.selector``) for every platform, since CPU tests run them through
conformance doubles of their libraries. A GPU kernel touches only this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raymoe.platform.cuda.causal_conv1d import CausalConv1dKernels
from raymoe.platform.cuda.deepgemm_experts import DeepGemmExperts
from raymoe.platform.cuda.experts import CudaExpertOps
from raymoe.platform.cuda.fla_gated_delta import FlaGatedDelta
from raymoe.platform.cuda.fp8_gemm import BlockFp8Gemm
from raymoe.platform.cuda.graphs import CudaGraphCapture
from raymoe.platform.cuda.grouped_mm import GroupedGemm, TorchGroupedMm
from raymoe.platform.cuda.streams import CudaHostCopy, CudaTboStreams, default_cuda_api
from raymoe.platform.interface import BackendRegistry, BlockScales, GraphCapture, HostCopy, WeightKind
from raymoe.platform.reference.platform import TorchPlatform


class CudaPlatform(CudaExpertOps, TorchPlatform):
    """The CUDA platform (module docstring).

    Args:
        backends: as :class:`~raymoe.platform.reference.platform.TorchPlatform`.
        cuda_api: the CUDA stream/event API (``torch.cuda``, the default; tests pass a strict double).
        grouped_gemm: the experts' grouped GEMM (default :class:`~raymoe.platform.cuda.grouped_mm.TorchGroupedMm`;
            CPU tests pass a strict double of it).
        fp8_gemm: the block-scaled FP8 linear (None: :class:`~raymoe.platform.cuda.fp8_gemm.BlockFp8Gemm` over
            torch's ``scaled_mm``; tests pass one over a conformance double).
        fp8_experts: the FP8 experts' grouped GEMMs (None: :class:`~raymoe.platform.cuda.deepgemm_experts.
            DeepGemmExperts` over ``deep_gemm``, imported on first use; tests pass one over a conformance double).
        gated_delta: hybrid models' gated delta rule kernels (None: :class:`~raymoe.platform.cuda.fla_gated_delta.
            FlaGatedDelta` over ``fla``, imported on first use; tests pass one over a conformance double).
        causal_conv1d: hybrid models' causal conv kernels (None: :class:`~raymoe.platform.cuda.causal_conv1d.
            CausalConv1dKernels` over ``causal_conv1d``, imported on first use; tests pass one over a double).
    """

    name = "cuda"
    default_tbo_decode_schedule = "fine"
    fixed_shape_decode = True
    async_host_copy = True

    def __init__(self, backends: BackendRegistry | None = None, cuda_api: Any = None,
                 grouped_gemm: GroupedGemm | None = None, fp8_gemm: BlockFp8Gemm | None = None,
                 fp8_experts: DeepGemmExperts | None = None, gated_delta: FlaGatedDelta | None = None,
                 causal_conv1d: CausalConv1dKernels | None = None):
        super().__init__(backends)
        self.cuda = cuda_api if cuda_api is not None else default_cuda_api()
        self.grouped_gemm = grouped_gemm if grouped_gemm is not None else TorchGroupedMm()
        self.fp8_gemm = fp8_gemm or BlockFp8Gemm()
        self.fp8_experts = fp8_experts or DeepGemmExperts()
        self.gated_delta = gated_delta or FlaGatedDelta()
        self.causal_conv1d = causal_conv1d or CausalConv1dKernels()
        self._tbo_streams: CudaTboStreams | None = None

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

    def copy_to_host(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Non-blocking copies into pinned memory behind the current stream, and an event after them."""
        return CudaHostCopy(tensors, self.cuda)

    def stream_scope(self) -> Any:
        """The current stream: a constant a second stream's kernels read must have been made on that stream."""
        return self.cuda.current_stream()

    def tbo_streams(self) -> CudaTboStreams:
        """The rank's second stream for two-batch overlap, made on first use on the current device."""
        if self._tbo_streams is None:
            self._tbo_streams = CudaTboStreams(self.cuda)
        return self._tbo_streams
