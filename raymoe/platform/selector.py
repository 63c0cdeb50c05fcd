"""Choosing a rank's platform, once, from its device and dtype: the only module that imports the platform
implementations (``raymoe.platform.reference``, ``.cpu``, ``.cuda``; the import contract in ``pyproject.toml``
enforces it).

It also registers the GPU libraries' adapters (flash-attention, FlashInfer's MLA, DeepEP) with every platform it
builds, as lazy factories: they are selected by name (``attention_backend``, ``a2a_backend``), import their package
only when built, and run on CPU through conformance doubles of their libraries in tests.
"""

from __future__ import annotations

from typing import Any

import torch

from raymoe.comm.dispatcher import A2ABackendSpec, MoeDispatcher
from raymoe.comm.groups import ParallelGroups
from raymoe.platform.interface import BackendRegistry, Platform


def _flash_attn(**kwargs: Any):
    from raymoe.platform.cuda.flash_attn import FlashAttnBackend

    return FlashAttnBackend(**kwargs)


def _flashinfer_mla(**kwargs: Any):
    from raymoe.platform.cuda.flashinfer_mla import FlashInferMLABackend

    return FlashInferMLABackend(**kwargs)


def _deepep(groups: ParallelGroups, num_experts: int, spec: A2ABackendSpec, hidden_size: int,
            dtype: torch.dtype, buffer_factory: Any = None, fp8_experts: bool = False) -> MoeDispatcher:
    """DeepEP; low-latency dispatches move FP8 rows where the experts are FP8 (128 x 128 blocks) and DeepEP's FP8
    dispatch takes the rows (bfloat16, hidden a multiple of 512), as SGLang runs DeepSeek-V3's FP8 checkpoint."""
    from raymoe.platform.cuda.deepep import DeepEPDispatcher

    use_fp8 = fp8_experts and spec.mode != "normal" and dtype == torch.bfloat16 and hidden_size % 512 == 0
    return DeepEPDispatcher(groups, num_experts, hidden_size=hidden_size, dtype=dtype,
                            num_max_dispatch_tokens_per_rank=spec.num_max_dispatch_tokens_per_rank,
                            low_latency=spec.mode != "normal", buffer_factory=buffer_factory, use_fp8=use_fp8)


GPU_LIBRARY_BACKENDS = BackendRegistry(attention={"flash_attn": _flash_attn}, dispatchers={"deepep": _deepep},
                                       mla_attention={"flashinfer_mla": _flashinfer_mla})
"""The adapters of the GPU libraries every platform builds by name."""


def select_platform(device: torch.device | str, dtype: torch.dtype = torch.float32,
                    backends: BackendRegistry = GPU_LIBRARY_BACKENDS) -> Platform:
    """The platform of a rank computing on ``device`` with model ``dtype``: CPU (the C kernels, shared-memory
    exchange, process tuning), CUDA (CUDA graphs, SGLang's decode overlap schedule), or the torch reference for
    any other device (``meta`` in device-cleanliness tests).

    Args:
        device: the rank's device. dtype: its model dtype. backends: the adapters registered by name (tests
            register conformance doubles).
    """
    kind = torch.device(device).type
    if kind == "cpu":
        from raymoe.platform.cpu.platform import CpuPlatform

        return CpuPlatform(dtype, backends)
    if kind == "cuda":
        from raymoe.platform.cuda.platform import CudaPlatform

        return CudaPlatform(backends)
    from raymoe.platform.reference.platform import TorchPlatform

    return TorchPlatform(backends)


def reference_platform(backends: BackendRegistry = GPU_LIBRARY_BACKENDS) -> Platform:
    """The torch reference platform on any device (tests compare every platform against it)."""
    from raymoe.platform.reference.platform import TorchPlatform

    return TorchPlatform(backends)
