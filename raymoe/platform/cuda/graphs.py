"""CUDA graph capture of decode buckets (``torch.cuda.CUDAGraph``): each bucket's forward is warmed up on a side
stream (lazy inits, allocator, kernel selection), then captured into one memory pool shared by every graph; all
graphs write their logits into one buffer (``[max_bs, V]`` float32), so a replay returns a view of it. A forward
that returns more than its logits (a tuple: the final hidden states a draft model reads, a draft's tokens) has one
shared buffer per output."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CudaGraphStep:
    """A captured graph and the output rows it writes (fixed addresses in the pool)."""

    def __init__(self, graph, output: torch.Tensor | tuple[torch.Tensor, ...]):
        self.graph = graph
        self.output = output

    def replay(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The bucket's outputs, as the captured forward returned them (views of the shared buffers): logits
        [bs, V] float32, or a tuple of tensors with ``bs`` rows first."""
        self.graph.replay()
        return self.output


class CudaGraphCapture:
    """:class:`~raymoe.platform.interface.GraphCapture` with CUDA graphs on ``device``.

    Args:
        device: the rank's CUDA device. warmup_runs: eager runs before each capture.
    """

    fixed_kv_width = True
    binds_addresses = True

    def __init__(self, device: torch.device, warmup_runs: int = 2):
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self._outputs: list[torch.Tensor] | None = None  # per output [max_bs, ...] shared by every graph

    def capture(self, run: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]], bs: int, max_bs: int,
                host_sync_free: bool) -> CudaGraphStep:
        """Warm up, then capture ``run`` writing each output into its shared buffer's first ``bs`` rows.

        Raises:
            RuntimeError: the capture failed, e.g. the forward read a device value on the host, or it returned
                another number of outputs than the first bucket's.
        """

        def run_into_output():
            got = run()
            outs = got if isinstance(got, tuple) else (got,)
            if self._outputs is None:  # first (eager warm-up) run of the largest bucket: the shapes are known now
                self._outputs = [o.new_empty((max_bs, *o.shape[1:])) for o in outs]
            if len(outs) != len(self._outputs):
                raise RuntimeError(f"bucket {bs} returned {len(outs)} outputs, the first bucket "
                                   f"{len(self._outputs)}")
            copied = tuple(buf[:bs].copy_(o) for buf, o in zip(self._outputs, outs, strict=True))
            return copied if isinstance(got, tuple) else copied[0]

        try:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(self.warmup_runs):
                    run_into_output()
            torch.cuda.current_stream().wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                output = run_into_output()
        except RuntimeError as e:
            raise RuntimeError(f"CUDA graph capture of decode batch size {bs} failed: {e}. The forward must not sync "
                               "with the host; or set disable_cuda_graph=True") from e
        return CudaGraphStep(graph, output)

    def finish(self) -> None:
        """Wait for the device: every capture is complete."""
        torch.cuda.synchronize(self.device)
