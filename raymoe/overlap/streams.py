"""Streams of a two-batch-overlap forward: the protocol a platform's streams follow, and how the executor uses it.

On one stream the device runs a TBO step's kernels in the order the host issued them, so a child waiting for its
all-to-all (``Work.wait()`` makes the current stream wait for NCCL's stream; the normal mode's count exchange
even blocks the host) also holds back every kernel of the other child issued after it. With streams, child A runs
on the stream the forward started on and child B on a second stream; each child's waits then hold back only
itself, and a host sync in one child (the normal mode's count exchange) waits only for that child's kernels.

The choreography (:func:`execute_overlapped_operations` in ``raymoe.overlap.operations``):

* **fork**: before the first stage, the second stream waits for an event recorded on the parent stream, so
  child B sees everything the step prepared (embeddings, tables, attention metadata);
* each stage runs with its child's stream current (:meth:`TboStreams.child`);
* **join**: after the last stage, the parent stream waits for an event recorded on the second stream, and the
  tensors child B made that the parent goes on reading (its hidden states and residual) are recorded on the
  parent stream (``Tensor.record_stream``), so the caching allocator does not hand their memory to the second
  stream's next allocation while the parent's kernels may still read it. Tensors the parent made and child B
  read (the split views of the parent's hidden states, the tables) stay referenced by the parent until after the
  join, so their memory is not reused before child B's last kernel.

Not used where the MoE exchange receives through hooks called on the current stream in launch order (DeepEP's
low-latency kernels, SGLang's TBO): DeepEP alternates two receive buffers by launch order on the host, and
kernels of two streams could run in another order on the device. The platform provides the streams
(``Platform.tbo_streams``; CUDA: ``raymoe.platform.cuda.tbo_streams``); CPU and the reference have none and run
both children on the one stream, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch


class TboStreams(Protocol):
    """The streams of one rank's TBO forwards (see the module docstring for the rules)."""

    def fork(self) -> None:
        """Before the children run: make the second stream wait for the current (parent) stream's work so far."""

    def child(self, index: int) -> AbstractContextManager:
        """Context in which child ``index`` (0 = A, 1 = B) issues its kernels: A on the parent stream, B on the
        second stream."""

    def join(self, child_outputs: Sequence[torch.Tensor]) -> None:
        """After the last stage: make the parent stream wait for the second stream, and record ``child_outputs``
        (tensors child B made that the parent reads from now on) on the parent stream."""
