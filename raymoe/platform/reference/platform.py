"""TorchPlatform: the reference :class:`~raymoe.platform.interface.Platform`, torch operators on any device and
dtype. Other platforms subclass it and override what their kernels do faster; what they do not override, and the
calls their kernels cannot take, run here."""

from __future__ import annotations

from typing import Any

import torch

from raymoe.attention.base import AttentionBackend
from raymoe.comm.dispatcher import A2ABackendSpec, MoeDispatcher, TorchDispatcher
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.transport import EpTransport
from raymoe.platform.interface import BackendRegistry, GraphCapture, HostCopy, Platform
from raymoe.platform.reference.dense import DenseOps
from raymoe.platform.reference.experts import ExpertOps
from raymoe.platform.reference.graphs import RecordingCapture
from raymoe.platform.reference.sampling import SamplingOps


class TorchPlatform(DenseOps, ExpertOps, SamplingOps, Platform):
    """The reference platform.

    Args:
        backends: attention backends and MoE dispatchers built by name besides ``torch_native`` and ``torch``
            (the selector registers the GPU libraries' adapters; empty: those two only).
    """

    name = "torch"

    def __init__(self, backends: BackendRegistry | None = None):
        self.backends = backends or BackendRegistry()

    def attention_backend(self, name: str, **kwargs: Any) -> AttentionBackend:
        if name == "torch_native" and ("windows" in kwargs or "sinks" in kwargs):
            from raymoe.attention.sink_window import SinkWindowAttnBackend

            return SinkWindowAttnBackend(**kwargs)
        if name == "torch_native":
            from raymoe.attention.torch_native import TorchNativeAttnBackend

            return TorchNativeAttnBackend(**kwargs)
        factory = self.backends.attention.get(name)
        if factory is None:
            raise ValueError(f"unknown attention backend {name!r}")
        return factory(**kwargs)

    def mla_attention_backend(self, name: str, **kwargs: Any) -> AttentionBackend:
        if name == "torch_native":
            from raymoe.attention.mla_torch_native import TorchNativeMLABackend

            return TorchNativeMLABackend(**kwargs)
        factory = self.backends.mla_attention.get(name)
        if factory is None:
            raise ValueError(f"attention backend {name!r} has no MLA implementation; use 'torch_native' or one of "
                             f"{sorted(self.backends.mla_attention)}")
        return factory(**kwargs)

    def create_ep_transport(self, groups: ParallelGroups, cpu_comm: str, timeout_s: float) -> EpTransport | None:
        return None

    def create_dispatcher(self, spec: A2ABackendSpec, groups: ParallelGroups, num_experts: int, hidden_size: int,
                          dtype: torch.dtype, intermediate_size: int, fp8_experts: bool = False) -> MoeDispatcher:
        if spec.name == "torch":
            return TorchDispatcher(groups, num_experts, self, expert_row_macs=3 * hidden_size * intermediate_size)
        factory = self.backends.dispatchers.get(spec.name)
        if factory is None:
            raise ValueError(f"unknown all-to-all backend {spec.name!r} (expected torch or one of "
                             f"{sorted(self.backends.dispatchers)})")
        return factory(groups, num_experts, spec, hidden_size, dtype, fp8_experts=fp8_experts)

    def write_bytes(self, dst: torch.Tensor, offset: int, src: torch.Tensor) -> None:
        nbytes = src.numel() * src.element_size()
        dst[offset:offset + nbytes].view(src.dtype).view(src.shape).copy_(src)

    def graph_capture(self, device: torch.device) -> GraphCapture:
        return RecordingCapture()

    def copy_to_host(self, tensors) -> HostCopy:
        """Host tensors as they are (no copy: the step computed them synchronously); others copied now."""
        return DoneHostCopy([t if t.device.type == "cpu" else t.to("cpu") for t in tensors])


class DoneHostCopy:
    """A :class:`~raymoe.platform.interface.HostCopy` that is complete when made (synchronous devices)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        """Nothing to wait for."""
