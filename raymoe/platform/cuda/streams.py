"""Streams and events of a CUDA rank: the step's token copy to the host, and the second stream of two-batch overlap.

Both take the CUDA API as an object (``torch.cuda`` by default: ``Stream``, ``Event``, ``current_stream``,
``stream``), so CPU tests run them through a strict double of those calls (``tests/cuda_stream_double.py``, which
checks every cross-stream use against the events recorded and waited for).

* :class:`CudaHostCopy`: ``tensor.to("cpu", non_blocking=True)`` into pinned memory (``_to_copy`` pins the host
  side of a non-blocking device-to-host copy), then an event recorded behind the copies on the current stream;
  the host waits on that event only when it needs the values (SGLang's ``copy_done`` event of its overlap
  scheduler). The caching host allocator records its own event on the pinned block, so the block is not reused
  before the copy lands.
* :class:`CudaTboStreams`: the fork, per-child stream and join of ``raymoe.overlap.streams`` over one second
  stream, made once per rank and reused by every TBO forward (and captured into decode graphs: a fork from the
  capturing stream and a join back into it are how CUDA graphs capture work on a second stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch


def default_cuda_api() -> Any:
    """The real CUDA API (``torch.cuda``)."""
    return torch.cuda


class CudaHostCopy:
    """Device tensors copied to pinned host memory behind the current stream's work (a
    :class:`~raymoe.platform.interface.HostCopy`).

    Args:
        tensors: device tensors (any shapes and dtypes). cuda: the CUDA API (``torch.cuda`` or a double).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], cuda: Any):
        self.tensors = [t.to("cpu", non_blocking=True) for t in tensors]
        self.done = cuda.Event()
        self.done.record()

    def ready(self) -> bool:
        """Whether every copy has landed (``Event.query``; never blocks)."""
        return self.done.query()

    def wait(self) -> None:
        """Block until the copies have landed (``Event.synchronize``: waits for the work before the copies only)."""
        self.done.synchronize()


class CudaTboStreams:
    """The second stream of two-batch-overlap forwards (a :class:`~raymoe.overlap.streams.TboStreams`).

    Args:
        cuda: the CUDA API (``torch.cuda`` or a double). The second stream is made on the current device.
    """

    def __init__(self, cuda: Any):
        self.cuda = cuda
        self.second = cuda.Stream()
        self.parent = None

    def fork(self) -> None:
        """The second stream waits for an event recorded now on the current (parent) stream."""
        self.parent = self.cuda.current_stream()
        forked = self.cuda.Event()
        forked.record(self.parent)
        self.second.wait_event(forked)

    def child(self, index: int):
        """Child 0 issues on the parent stream, child 1 on the second stream.

        Raises:
            RuntimeError: called before :meth:`fork`.
        """
        if self.parent is None:
            raise RuntimeError("CudaTboStreams.child() before fork()")
        return contextlib.nullcontext() if index == 0 else self.cuda.stream(self.second)

    def join(self, child_outputs: Sequence[torch.Tensor]) -> None:
        """The parent stream waits for an event recorded now on the second stream; ``child_outputs`` (made on the
        second stream, read by the parent from now on) are recorded on the parent stream for the allocator.

        Raises:
            RuntimeError: called before :meth:`fork`.
        """
        if self.parent is None:
            raise RuntimeError("CudaTboStreams.join() before fork()")
        joined = self.cuda.Event()
        joined.record(self.second)
        self.parent.wait_event(joined)
        for t in child_outputs:
            t.record_stream(self.parent)
        self.parent = None
