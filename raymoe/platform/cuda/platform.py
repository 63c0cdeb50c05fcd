"""CudaPlatform: the :class:`~raymoe.platform.interface.Platform` of a rank that computes on a CUDA GPU.

The reference operations run as CUDA kernels through torch; this platform adds expert GEMMs over the routed rows
only, in fixed shapes (``experts.py`` over ``grouped_mm.py``: ``torch._grouped_mm``'s CUTLASS path), decode capture
as CUDA graphs (``graphs.py``) and SGLang's fine-grained DECODE two-batch-overlap schedule. The GPU libraries'
adapters, flash-attention (``flash_attn.py``, ``flash_attn_provider.py``) and DeepEP (``deepep.py``,
``deepep_buffer.py``), are registered by the selector (``raymoe.platform.selector``) for every platform, since CPU
tests run them through conformance doubles of their libraries. A GPU kernel touches only this package.
"""

from __future__ import annotations

import torch

from raymoe.platform.cuda.experts import CudaExpertOps
from raymoe.platform.cuda.graphs import CudaGraphCapture
from raymoe.platform.cuda.grouped_mm import GroupedGemm, TorchGroupedMm
from raymoe.platform.interface import BackendRegistry, GraphCapture
from raymoe.platform.reference.platform import TorchPlatform


class CudaPlatform(CudaExpertOps, TorchPlatform):
    """The CUDA platform (module docstring).

    Args:
        backends: see :class:`~raymoe.platform.reference.platform.TorchPlatform`.
        grouped_gemm: the experts' grouped GEMM (default :class:`~raymoe.platform.cuda.grouped_mm.TorchGroupedMm`;
            CPU tests pass a strict double of it).
    """

    name = "cuda"
    default_tbo_decode_schedule = "fine"
    fixed_shape_decode = True

    def __init__(self, backends: BackendRegistry | None = None, grouped_gemm: GroupedGemm | None = None):
        super().__init__(backends)
        self.grouped_gemm = grouped_gemm if grouped_gemm is not None else TorchGroupedMm()

    def graph_capture(self, device: torch.device) -> GraphCapture:
        return CudaGraphCapture(device)
