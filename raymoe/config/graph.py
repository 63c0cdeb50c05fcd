"""Decode graph capture options."""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class GraphConfig:
    """Decode graph capture (CUDA graphs on GPU, static-buffer callables on CPU; ``raymoe.runner.graph_runner``).

    Attributes:
        disable_cuda_graph: decode eagerly, capture nothing.
        cuda_graph_max_bs: largest captured batch size (None: ``max_running_requests``).
        cuda_graph_bs: explicit batch sizes to capture (None: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to the max).
        enable_torch_compile: run captured forwards through ``torch.compile`` (slower on CPU; see bench graph).
        cuda_graph_min_kv_width: tokens; on CUDA each bucket is also captured at KV widths from this one, doubling,
            up to ``max_context_len``, and a replay attends over the narrowest width that holds its longest
            sequence (paged SDPA backends; ``raymoe.runner.graph_buckets.kv_width_ladder``). None: one width,
            ``max_context_len`` (fewer graphs, slower decode of short sequences).
    """

    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    enable_torch_compile: bool = False
    cuda_graph_min_kv_width: int | None = 128

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise InvalidRequestError("cuda_graph_max_bs", "must be >= 1")
        w = self.cuda_graph_min_kv_width
        if w is not None and (not isinstance(w, int) or w < 1):
            raise InvalidRequestError("cuda_graph_min_kv_width", f"must be a positive integer or None, got {w!r}")
        if self.cuda_graph_bs is not None:
            sizes = tuple(int(b) for b in self.cuda_graph_bs)
            if not sizes or min(sizes) < 1:
                raise InvalidRequestError("cuda_graph_bs", "must be a non-empty list of positive batch sizes")
            object.__setattr__(self, "cuda_graph_bs", sizes)
