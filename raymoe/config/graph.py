"""Decode graph capture options (declarations: ``raymoe.config.option``)."""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.config.option import option
from raymoe.errors import InvalidRequestError

DEFAULT_MIN_KV_WIDTH = 128  # tokens: first KV width of the decode-graph width ladder (runner.graph_buckets)


@dataclass(frozen=True)
class GraphConfig:
    """Decode graph capture (CUDA graphs on GPU, static-buffer callables on CPU; ``raymoe.runner.graph_runner``);
    each field's help says what it means.

    Raises:
        InvalidRequestError: a size that is not a positive integer (names the field).
    """

    disable_cuda_graph: bool = option(False, help="decode eagerly, capture no decode graphs.")
    cuda_graph_max_bs: int | None = option(
        None, help="largest captured decode batch size (None: max_running_requests).")
    cuda_graph_bs: tuple[int, ...] | None = option(
        None, help="explicit decode batch sizes to capture (None: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to the "
                   "largest); a batch above the largest one runs eagerly.")
    enable_torch_compile: bool = option(
        False, help="run the captured forwards through torch.compile (slower on CPU; see raymoe bench graph).")
    cuda_graph_min_kv_width: int | None = option(
        DEFAULT_MIN_KV_WIDTH,
        help="tokens; on CUDA each bucket is also captured at KV widths from this one, doubling, up to "
             "max_context_len, and a replay attends over the narrowest width that holds its longest sequence (paged "
             "SDPA backends; raymoe.runner.graph_buckets.kv_width_ladder). None: one width, max_context_len (fewer "
             "graphs, slower decode of short sequences). CPU ignores it (its replays narrow dynamically).")

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
