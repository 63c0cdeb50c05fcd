"""Primitives of the DeepEP double (``deep_ep_double``): host-assert errors, not-yet-received tensors, events."""

from __future__ import annotations

import socket

import torch

NUM_MAX_NVL_PEERS, NUM_MAX_LOCAL_EXPERTS = 8, 1024
NUM_MAX_RDMA_PEERS = 20               # csrc/kernels/configs.cuh
ALIGN, SOURCE_META_BYTES, INT_MAX = 128, 8, 2**31 - 1
# Limits of DeepEP v1.2.1's kernels (host asserts unless noted; a device assert traps the kernel, also an error):
INTRANODE_RANKS = (2, 4, 8)           # csrc/kernels/launch.cuh SWITCH_RANKS (intranode dispatch/combine/notify)
NOTIFY_MAX_LOCAL_EXPERTS = 128        # csrc/kernels/intranode.cu notify_dispatch: experts / ranks <= kNumThreads
INTRANODE_MAX_TOPK = 32               # csrc/kernels/intranode.cu dispatch and combine: device assert num_topk <= 32
DISPATCH_TMA_BYTES_PER_WARP = 8192    # csrc/kernels/intranode.cu dispatch (SM90): hidden_int4 % 2 == 0 and
                                      # hidden bytes / 2 + 8 <= kNumTMABytesPerWarp (device assert)
LL_MAX_TOPK = 11                      # csrc/kernels/internode_ll.cu dispatch and combine: kNumMaxTopK = 11
WORKSPACE_BYTES = 32 << 20            # csrc/kernels/configs.cuh NUM_WORKSPACE_BYTES
NUM_DEVICE_SMS = 132                  # an H100 SXM / H200 (the low-latency launch shape depends on it)
# Internode kernels (csrc/kernels/internode.cu, v1.2.1):
INTERNODE_RDMA_RANKS = (2, 4, 8, 16, 18, 20)  # launch.cuh SWITCH_RDMA_RANKS (notify_dispatch, dispatch, combine)
INTERNODE_MAX_TOPK = 32               # dispatch and combine: device assert num_topk <= 32
INTERNODE_MAX_TOPK_NODES = 8          # get_num_topk_rdma_ranks: a token reaches at most min(rdma ranks, 8) nodes
INTERNODE_TMA_BYTES_PER_WARP = 16384  # dispatch kNumTMABytesPerWarp, combine kNumTMABytesPerSenderWarp: one
                                      # token message + 8 bytes must fit (device assert)
INTERNODE_NOTIFY_THREADS = 512        # notify_dispatch kNumThreads: experts per node and per rank <= it
INTERNODE_COMBINE_FORWARDER_WARPS = 24  # combine kNumCombineForwarderWarps (host asserts on the config)

_NODE: list[str] = []  # the emulated node of this process's rank (simulate_node), else the host name


def simulate_node(name: str | None) -> None:
    """Name the node this process's rank runs on. Spawned gloo ranks of a test share one machine, where DeepEP
    would see one node; a test that emulates a cluster gives each rank the node its placement put it on (None:
    the real host name again)."""
    _NODE[:] = [] if name is None else [name]


def this_node() -> str:
    """The node of this process's rank: :func:`simulate_node`'s, else ``socket.gethostname()``."""
    return _NODE[0] if _NODE else socket.gethostname()


class DoubleMisuse(RuntimeError):
    """A call the real library rejects (``EP_HOST_ASSERT``) or would silently get wrong."""


def misuse(message: str) -> DoubleMisuse:
    return DoubleMisuse(f"DeepEP double: {message}")


def check(cond: bool, what: str) -> None:
    """DeepEP's ``EP_HOST_ASSERT`` (a RuntimeError from the C++ runtime)."""
    if not cond:
        raise misuse(f"assertion failed: {what}")


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every id is an expert or -1 (DeepEP reads out of bounds otherwise: stricter than the library)."""
    check(bool(((topk_idx >= -1) & (topk_idx < num_experts)).all()), f"topk_idx outside [-1, {num_experts})")


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.is_contiguous, torch.Tensor.element_size,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__}


class Unreceived(torch.Tensor):
    """A result whose data has not arrived: reading it raises; :func:`deliver` makes it a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        why = next((getattr(a, "_double_why", "") for a in args if isinstance(a, Unreceived)), "")
        raise misuse(f"read of a DeepEP result before it was received ({why}): call "
                     f"{'hook()' if 'hook' in why else 'event.current_stream_wait()'} first")


def pending(t: torch.Tensor, why: str) -> torch.Tensor:
    """An :class:`Unreceived` alias of ``t`` (same storage; fill ``t``, then :func:`deliver` the alias)."""
    alias = t.as_subclass(Unreceived)
    alias._double_why = why
    return alias


def deliver(*aliases) -> None:
    for a in aliases:
        if isinstance(a, Unreceived):
            a.__class__ = torch.Tensor


class EventHandle:
    """A CUDA event's stand-in: pending gloo works and the deliveries to run once they are waited for."""

    def __init__(self, works=(), on_wait=None):
        self._works, self._on_wait = list(works), on_wait

    def current_stream_wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
        if self._on_wait is not None:
            on_wait, self._on_wait = self._on_wait, None
            on_wait()


class EventOverlap:
    """``deep_ep.EventOverlap``: ``event`` (None unless ``async_finish``), ``extra_tensors`` kept alive."""

    def __init__(self, event: EventHandle | None = None, extra_tensors=None) -> None:
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


