"""CudaPlatform: the :class:`~raymoe.platform.interface.Platform` of a rank that computes on a CUDA GPU.

The reference operations run as CUDA kernels through torch; this platform adds decode capture as CUDA graphs
(``graphs.py``) and SGLang's fine-grained DECODE two-batch-overlap schedule. The GPU libraries' adapters,
flash-attention (``flash_attn.py``, ``flash_attn_provider.py``), FlashInfer's paged MLA (``flashinfer_mla.py``,
``flashinfer_mla_provider.py``) and DeepEP (``deepep.py``, ``deepep_buffer.py``),
are registered by the selector (``raymoe.platform.selector``) for every platform, since CPU tests run them through
conformance doubles of their libraries. A GPU kernel touches only this package.
"""

from __future__ import annotations

import torch

from raymoe.platform.cuda.graphs import CudaGraphCapture
from raymoe.platform.interface import GraphCapture
from raymoe.platform.reference.platform import TorchPlatform


class CudaPlatform(TorchPlatform):
    """The CUDA platform (module docstring); arguments as :class:`~raymoe.platform.reference.platform.TorchPlatform`."""

    name = "cuda"
    default_tbo_decode_schedule = "fine"
    fixed_shape_decode = True

    def graph_capture(self, device: torch.device) -> GraphCapture:
        return CudaGraphCapture(device)
