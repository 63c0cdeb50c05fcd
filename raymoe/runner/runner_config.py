"""``RunnerConfig``: what one rank needs to build its ``ModelRunner`` (plain data, sent to each ``RankWorker``).

It holds the engine's option records the rank uses (``GraphConfig``, ``MoeCommConfig``, ``OverlapConfig``) as they
are, plus the sizes derived for a rank; ``raymoe.actors.factory.runner_config_for`` builds it once per engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from raymoe.config import EplbConfig, GraphConfig, MoeCommConfig, OverlapConfig, SpeculativeConfig
from raymoe.eplb.location import ExpertLocation
from raymoe.runner.graph_buckets import capture_sizes, kv_width_ladder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}  # float64: exactness tests (e.g. graph replay vs eager)


@dataclass(frozen=True)
class RunnerConfig:
    """One rank's runner settings.

    Attributes:
        model_path: Hugging Face folder. dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"`` (| ``"float64"``,
            for exactness tests).
        num_kv_slots: KV slots of the pool (without dummy slot 0), tokens.
        max_req_rows: rows of the ReqToTokenPool table. max_context_len: tokens per row.
        page_size: tokens per KV page the driver's allocator hands out (``CacheConfig.page_size``); the pool
            (``num_kv_slots + 1`` rows) must be a whole number of pages.
        attention_backend: ``EngineConfig.attention_backend`` (``flash_attn`` is checked here: package, dtype, page
            size). seed: sampler seed. device: ``"cpu"`` or ``"cuda"``.
        graph: decode graph capture (the engine's ``GraphConfig``; ``cuda_graph_max_bs`` None caps at
            ``max_req_rows``). On CPU the "graphs" are static-buffer callables with the same contract
            (``raymoe.runner.graph_runner``).
        moe_comm: the MoE all-to-all options (the engine's ``MoeCommConfig``, with ``a2a_mode`` as the ranks run it,
            ``Platform.effective_a2a_mode``; decode graphs capture the mode a decode step resolves
            to).
        overlap: two-batch / single-batch overlap options (the engine's ``OverlapConfig``; same on every rank).
        inject_a2a_latency_ms: benchmarks only: delay each MoE dispatch/combine completion by this one-way
            latency, milliseconds (``raymoe.comm.latency``; 0 = off).
        cpu_threads: intra-op threads of a rank process on CPU (``EngineConfig.cpu_threads``; None: derived).
        cpu_rank_nice: nice value of a multi-rank engine's CPU rank step thread (``EngineConfig.cpu_rank_nice``;
            None: the default, -10).
        eplb: the engine's expert load balancing options (``EplbConfig``). expert_location: the placement the
            ranks load (``raymoe.eplb.location``; None: one slot per expert, nothing recorded).
        speculative: the engine's speculative decoding options (``nextn``: the ranks build the model's MTP layer
            and draft with it, ``raymoe.runner.mtp_drafter``).
        swa_kv_eviction: sliding-window layers' KV in per-row rings (``CacheConfig.swa_kv_eviction``).
        weight_tensors: the weights of the last update from tensors (a mapping of Hugging Face names to tensors, or
            a Ray ``ObjectRef`` to one; ``raymoe.actors.weight_update``), loaded over ``model_path``'s when the rank
            is built again after a fault; None: the folder's.
    Raises:
        ValueError: a size out of range, an unknown dtype, or graph sizes that cannot be captured.
        InvalidRequestError: ``flash_attn`` with a dtype or page size it does not take, or without its package.
    """

    model_path: str
    dtype: str
    num_kv_slots: int
    max_req_rows: int
    max_context_len: int
    page_size: int = 1
    attention_backend: str = "torch_native"
    seed: int = 0
    device: str = "cpu"
    graph: GraphConfig = field(default_factory=GraphConfig)
    moe_comm: MoeCommConfig = field(default_factory=MoeCommConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    inject_a2a_latency_ms: float = 0.0
    cpu_threads: int | None = None
    cpu_rank_nice: int | None = None
    eplb: EplbConfig = field(default_factory=EplbConfig)
    expert_location: ExpertLocation | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    swa_kv_eviction: bool = False
    weight_tensors: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.inject_a2a_latency_ms < 0:
            raise ValueError("inject_a2a_latency_ms must be >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        if self.num_kv_slots < 1 or self.max_req_rows < 1 or self.max_context_len < 2:
            raise ValueError("num_kv_slots, max_req_rows must be >= 1 and max_context_len >= 2")
        if self.page_size < 1 or (self.num_kv_slots + 1) % self.page_size:
            raise ValueError(f"num_kv_slots + 1 ({self.num_kv_slots + 1}) must be a multiple of page_size "
                             f"({self.page_size})")
        from raymoe.platform.backends import check_attention_backend

        check_attention_backend(self.attention_backend, self.page_size, self.dtype)
        _ = self.graph_capture_sizes  # validates the graph sizes against max_req_rows

    @property
    def max_dispatch_tokens_per_rank(self) -> int:
        """Per-rank token bound of low-latency dispatches (sizes DeepEP's buffers), tokens:
        ``moe_comm.num_max_dispatch_tokens_per_rank`` or ``max_req_rows`` (the engine's ``max_running_requests``;
        times ``speculative_num_steps + 1`` with speculation: as ``EngineConfig.max_dispatch_tokens_per_rank``)."""
        return self.moe_comm.num_max_dispatch_tokens_per_rank or self.max_req_rows * self.speculative.tokens_per_request

    @property
    def graph_capture_sizes(self) -> tuple[int, ...]:
        """Decode-graph buckets every rank captures, ascending (empty when disabled); the driver passes them to
        ``raymoe.runner.graph_buckets.plan_graph_bs``."""
        if self.graph.disable_cuda_graph:
            return ()
        return tuple(capture_sizes(self.max_req_rows, self.graph.cuda_graph_bs, self.graph.cuda_graph_max_bs))

    @property
    def graph_kv_widths(self) -> tuple[int, ...]:
        """KV widths (tokens) every CUDA decode-graph bucket is captured at, ascending, ending at
        ``max_context_len`` (a rank-local choice per replay: only attention depends on it)."""
        return tuple(kv_width_ladder(self.max_context_len, self.graph.cuda_graph_min_kv_width))
