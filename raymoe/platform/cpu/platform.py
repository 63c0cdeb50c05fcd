"""CpuPlatform: the :class:`~raymoe.platform.interface.Platform` of a rank that computes on CPU.

What it adds to the reference (``raymoe.platform.reference``), each in a file of its own:

* fused float32 kernels in C (``kernels/``: built with the system C compiler on first use, bound through
  ``ctypes``; switched off by ``RAYMOE_CPU_KERNELS=0`` or a missing compiler, when the reference operations run):
  norms, q/k norm with rotary, routing, sampling (``dense.py``, ``sampling.py``), paged attention (``attention.py``),
  routed experts and the packed GEMM over weights packed at load (``experts.py``), the whole attention half of a
  layer as one call (``fusion.py``);
* the expert layout's cost model (``expert_layout.py``);
* the expert-parallel exchange through shared memory between ranks of one node (``transport.py``, ``shm*.py``),
  its waits sleeping on futexes (``futex.py``);
* process tuning: step-thread priority (``process.py``), the host allocator (``host_alloc.py``).

A CPU-only speed change touches only this package.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from raymoe.attention.base import AttentionBackend
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.transport import EpTransport
from raymoe.overlap.fusion import Fusion
from raymoe.platform.cpu import host_alloc, process, transport
from raymoe.platform.cpu.attention import CpuPagedAttnBackend
from raymoe.platform.cpu.dense import CpuDenseOps
from raymoe.platform.cpu.experts import CpuExpertOps
from raymoe.platform.cpu.fusion import ATTN_BLOCK_FUSIONS
from raymoe.platform.cpu.kernels import build
from raymoe.platform.cpu.sampling import CpuSamplingOps
from raymoe.platform.interface import BackendRegistry
from raymoe.platform.reference.platform import TorchPlatform


class CpuPlatform(CpuDenseOps, CpuExpertOps, CpuSamplingOps, TorchPlatform):
    """The CPU platform (module docstring).

    Args:
        dtype: the rank's model dtype; the attention-block fusion is considered for float32 only (every other
            kernel decides per call from its tensors: a bfloat16 model still samples float32 logits).
        backends: see :class:`~raymoe.platform.reference.platform.TorchPlatform`.
    """

    name = "cpu"
    default_tbo_decode_schedule = "coarse"

    def __init__(self, dtype: torch.dtype = torch.float32, backends: BackendRegistry | None = None):
        super().__init__(backends)
        self.dtype = dtype

    def attention_backend(self, name: str, **kwargs: Any) -> AttentionBackend:
        if name == "torch_native" and "windows" not in kwargs and "sinks" not in kwargs:
            return CpuPagedAttnBackend(**kwargs)  # its kernels take neither sinks nor windows
        return super().attention_backend(name, **kwargs)

    def mla_attention_backend(self, name: str, **kwargs: Any) -> AttentionBackend:
        if name == "torch_native":  # absorbed decode through the fused kernel (raymoe.platform.cpu.mla_attention)
            from raymoe.platform.cpu.mla_attention import CpuMLABackend

            return CpuMLABackend(**kwargs)
        return super().mla_attention_backend(name, **kwargs)

    def create_ep_transport(self, groups: ParallelGroups, cpu_comm: str, timeout_s: float) -> EpTransport | None:
        """The shared-memory exchange where every EP rank is on this node (``transport.create_ep_transport``)."""
        return transport.create_ep_transport(groups, cpu_comm, timeout_s)

    def write_bytes(self, dst: torch.Tensor, offset: int, src: torch.Tensor) -> None:
        """One ``memmove`` for CPU tensors: a tensor call costs more than copying a decode step's few kilobytes."""
        if dst.device.type != "cpu" or src.device.type != "cpu":
            return super().write_bytes(dst, offset, src)
        src = src.contiguous()
        ctypes.memmove(dst.data_ptr() + offset, src.data_ptr(), src.numel() * src.element_size())

    def fusions(self) -> Sequence[Fusion]:
        """The attention-block fusions for a float32 model where the kernel library loads."""
        if self.dtype != torch.float32 or build.load() is None:
            return ()
        return ATTN_BLOCK_FUSIONS

    def tune_rank_memory(self) -> None:
        """Keep freed host blocks for reuse (``host_alloc.tune_host_allocator``)."""
        host_alloc.tune_host_allocator()

    def configure_step_thread(self, cpu_rank_nice: int | None, multi_rank: bool) -> None:
        """Nice ``cpu_rank_nice`` (default ``process.DEFAULT_RANK_NICE``; 0 leaves it) for the step thread of a rank
        that meets peers every step; a one-rank engine is left alone."""
        if not multi_rank:
            return
        nice = process.DEFAULT_RANK_NICE if cpu_rank_nice is None else cpu_rank_nice
        process.raise_step_thread_priority(nice or None)
