"""Injected all-to-all latency, for overlap benchmarks only (``RunnerConfig.inject_a2a_latency_ms``).

This machine's kernel has no netem, so a slower interconnect is emulated in user space: each dispatch and each
combine transfer completes no earlier than ``latency`` seconds after its ``_a`` call posted it. The ``_b`` half
first waits for the real transfer, then sleeps until ``start + latency`` if that moment has not passed yet.
``start`` is when the inner ``_a`` returns: for a normal-mode dispatch that is after its blocking exchange of row
counts, which lines the ranks up, so a rank that arrived early pays the wait for its peer *and* the latency, as on
a real network, instead of hiding one behind the other. (A combine, and a low-latency dispatch, have no such
exchange; a peer that posts late can still hide part of the latency there.) Work done between ``_a`` and ``_b``
(the other half-batch under two-batch overlap) therefore hides the latency, exactly as it would hide a real
one-way network latency; a serial schedule pays it in full. A combine sent in parts completes
``latency`` after its last part started. Sleeping releases the CPU, so the other rank's compute is not slowed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class LatencyInjectedAllToAll:
    """Wraps an all-to-all backend (``dispatch_a/_b``, ``combine_a/_b``) and delays each transfer's completion.

    Args:
        inner: the real backend.
        latency_s: one-way latency per transfer, seconds (>= 0).
        clock, sleep: time source and sleep function (injectable for tests).

    Attributes:
        slept_s, waits: seconds slept so far and ``_b`` calls so far (diagnostics: the part of the injected
            latency that was not hidden is ``slept_s / (waits * latency_s)``).
    """

    def __init__(self, inner, latency_s: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        self.inner = inner
        self.latency_s = latency_s
        self.clock = clock
        self.sleep = sleep
        self._dispatch_start: dict[int, float] = {}
        self._combine_start: dict[int, float] = {}
        self.slept_s = 0.0
        self.waits = 0

    def __getattr__(self, name):  # ep_size, num_local_experts, ... of the wrapped backend
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _wait_until(self, deadline: float) -> None:
        self.waits += 1
        remaining = deadline - self.clock()
        if remaining > 0:
            self.slept_s += remaining
            self.sleep(remaining)

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   capacity: int | None = None):
        handle = self.inner.dispatch_a(hidden, topk_ids, topk_weights, capacity)
        self._dispatch_start[id(handle)] = self.clock()
        return handle

    def dispatch_b(self, handle):
        out = self.inner.dispatch_b(handle)
        self._wait_until(self._dispatch_start.pop(id(handle)) + self.latency_s)
        return out

    def combine_a(self, handle, expert_out: torch.Tensor, part: int = 0, num_parts: int = 1) -> None:
        self.inner.combine_a(handle, expert_out, part=part, num_parts=num_parts)
        self._combine_start[id(handle)] = self.clock()

    def combine_b(self, handle) -> torch.Tensor:
        out = self.inner.combine_b(handle)
        self._wait_until(self._combine_start.pop(id(handle)) + self.latency_s)
        return out


def wrap_moe_all_to_all(model: torch.nn.Module, wrap: Callable[[object], object]) -> int:
    """Replace the ``a2a`` backend of every module of ``model`` that has one by ``wrap(a2a)``; returns the count.

    Used once after the model is built (latency injection, benchmark stand-ins), never during a step.
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "a2a"):
            module.a2a = wrap(module.a2a)
            n += 1
    return n


def inject_a2a_latency(model: torch.nn.Module, latency_ms: float) -> int:
    """Wrap every MoE all-to-all backend of ``model`` in :class:`LatencyInjectedAllToAll`; returns the count."""
    return wrap_moe_all_to_all(model, lambda a2a: LatencyInjectedAllToAll(a2a, latency_ms / 1000.0))
