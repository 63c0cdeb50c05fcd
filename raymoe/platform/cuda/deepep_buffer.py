"""The one DeepEP buffer of a process's expert-parallel group, shared by every MoE layer, and the rules of its use.

``deep_ep.Buffer`` owns pinned NVLink/RDMA memory and NVSHMEM state, so a process holds one per EP group and
every layer's :class:`~raymoe.platform.cuda.deepep.DeepEPDispatcher` uses it. :class:`SharedDeepEPBuffer` wraps it with
the bookkeeping DeepEP leaves to its caller:

* sizing from DeepEP's own hints (:func:`deepep_buffer_sizes`): the normal-mode NVLink/RDMA hints of the
  dispatch and combine configs, and, when the low-latency mode may run, ``get_low_latency_rdma_size_hint``;
* mode switches: after a normal-mode dispatch/combine, DeepEP requires ``clean_low_latency_buffer`` before the
  next low-latency kernel (:meth:`SharedDeepEPBuffer.enter_mode`). Every rank switches at the same step (the
  driver picks the mode once for all ranks, ``raymoe.comm.a2a_plan``), and the clean is collective;
* the two low-latency buffers: DeepEP alternates between two receive buffers, one per low-latency kernel
  (dispatch or combine), so the kernel launched two launches ago must have been received (its hook called)
  before the next launch, or its data is overwritten. :meth:`SharedDeepEPBuffer.acquire_low_latency` tracks the
  two slots and refuses a third result in flight with :class:`DeepEPInFlightError`.

Ownership: the registry (:func:`shared_deepep_buffer`) maps a live EP process group to its shared buffer; the
dispatchers of the layers hold references to it, never a buffer of their own.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

NORMAL, LOW_LATENCY = "normal", "low_latency"


class DeepEPInFlightError(RuntimeError):
    """A third low-latency DeepEP result would be in flight (DeepEP keeps two low-latency buffers)."""


@dataclass(frozen=True)
class DeepEPBufferSpec:
    """What sizes a DeepEP buffer; the same on every rank and every layer of a model.

    Attributes:
        hidden_size: H, elements per token row. hidden_bytes: bytes per row on the wire (``H * max(itemsize, 2)``,
            DeepEP's rule). num_experts: routed experts E (divisible by the EP size).
        num_max_dispatch_tokens_per_rank: M_max, most tokens one rank sends in a low-latency dispatch (sizes the
            low-latency buffers; DeepEP recommends <= 256).
        low_latency: whether the low-latency mode may run (``a2a_mode`` "low_latency" or "auto"); it allocates the
            RDMA buffer and starts NVSHMEM.
    """

    hidden_size: int
    hidden_bytes: int
    num_experts: int
    num_max_dispatch_tokens_per_rank: int
    low_latency: bool


def deepep_buffer_sizes(buffer_cls: Any, ep_size: int, spec: DeepEPBufferSpec) -> tuple[int, int, int]:
    """(num_nvl_bytes, num_rdma_bytes, num_qps_per_rank) for ``buffer_cls(group, ...)`` from DeepEP's hints.

    The low-latency mode needs at least one queue pair per local expert; the normal mode's internode kernels use
    ``Buffer.num_sms`` of them, so both modes together take the larger count.

    Raises:
        AssertionError: from DeepEP, when it has no tuned config for ``ep_size`` ranks.
    """
    nvl = rdma = 0
    for config in (buffer_cls.get_dispatch_config(ep_size), buffer_cls.get_combine_config(ep_size)):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(spec.hidden_bytes, ep_size))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(spec.hidden_bytes, ep_size))
    qps = buffer_cls.num_sms
    if spec.low_latency:
        rdma = max(rdma, buffer_cls.get_low_latency_rdma_size_hint(
            spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, ep_size, spec.num_experts))
        qps = max(qps, spec.num_experts // ep_size)
    return nvl, rdma, qps


class SharedDeepEPBuffer:
    """A ``deep_ep.Buffer`` plus the mode and low-latency-slot bookkeeping of its process (see module docstring).

    Args:
        buffer: the DeepEP buffer. spec: what sized it.
    """

    def __init__(self, buffer: Any, spec: DeepEPBufferSpec):
        self.buffer = buffer
        self.spec = spec
        self.last_mode: str | None = None
        self._slots: list[object | None] = [None, None]
        self._next_slot = 0

    @property
    def num_low_latency_in_flight(self) -> int:
        """Low-latency kernels launched whose data has not been received yet (0, 1 or 2)."""
        return sum(s is not None for s in self._slots)

    def enter_mode(self, mode: str) -> None:
        """Record that a ``mode`` kernel is about to run; before the first low-latency kernel after a normal one,
        clean DeepEP's low-latency buffer (a collective: every rank switches at the same step).

        Raises:
            DeepEPInFlightError: a normal-mode kernel while low-latency results are in flight (the two modes
                share the buffer's memory).
        """
        if mode == NORMAL and self.num_low_latency_in_flight:
            raise DeepEPInFlightError("a normal-mode DeepEP dispatch while low-latency results are in flight; "
                                      "every MoE call of a step must use the same mode")
        if mode == LOW_LATENCY and self.last_mode == NORMAL:
            s = self.spec
            self.buffer.clean_low_latency_buffer(s.num_max_dispatch_tokens_per_rank, s.hidden_size, s.num_experts)
        self.last_mode = mode

    def acquire_low_latency(self, owner: object) -> int:
        """Claim the low-latency slot DeepEP's next kernel will use, for ``owner`` (a handle); returns its index.

        Raises:
            DeepEPInFlightError: the slot still holds a kernel whose data was not received (a third result in
                flight; DeepEP would overwrite it).
        """
        slot = self._next_slot
        if self._slots[slot] is not None:
            raise DeepEPInFlightError(
                "a third low-latency DeepEP result would be in flight: DeepEP alternates between two low-latency "
                "buffers, so receive (dispatch_b / combine_b) the kernel launched two launches ago first")
        self._slots[slot] = owner
        self._next_slot = slot ^ 1
        return slot

    def release_low_latency(self, slot: int, owner: object) -> None:
        """Mark the kernel of ``owner`` in ``slot`` as received."""
        if self._slots[slot] is not owner:
            raise RuntimeError(f"low-latency slot {slot} is not held by this handle (received twice?)")
        self._slots[slot] = None


_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_deepep_buffer(group: Any, ep_size: int, spec: DeepEPBufferSpec, buffer_cls: Any) -> SharedDeepEPBuffer:
    """The process's shared buffer of EP group ``group``, built on first use with ``buffer_cls`` (``deep_ep.Buffer``
    or a class with its constructor and static methods) and reused by every later layer.

    Raises:
        ValueError: a later layer asks for another spec (every MoE layer of a model must share hidden size,
            expert count and the low-latency bound) or another buffer class.
    """
    shared = _REGISTRY.get(group)
    if shared is not None:
        if shared.spec != spec or type(shared.buffer) is not buffer_cls:
            raise ValueError(f"the DeepEP buffer of this EP group was built for {shared.spec} with "
                             f"{type(shared.buffer).__name__}; a layer asks for {spec} with {buffer_cls.__name__}")
        return shared
    nvl, rdma, qps = deepep_buffer_sizes(buffer_cls, ep_size, spec)
    buffer = buffer_cls(group, nvl, rdma, low_latency_mode=spec.low_latency, num_qps_per_rank=qps)
    shared = SharedDeepEPBuffer(buffer, spec)
    _REGISTRY[group] = shared
    return shared


def hidden_bytes_of(hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes per token row that DeepEP's size hints take: ``H * max(itemsize, 2)``."""
    return hidden_size * max(dtype.itemsize, 2)
