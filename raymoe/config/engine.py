"""``EngineConfig``: everything ``Engine(model, **options)`` accepts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from raymoe.config.graph import GraphConfig
from raymoe.config.parallel import MoeCommConfig, OverlapConfig, ParallelConfig
from raymoe.config.scheduling import CacheConfig, SchedulerConfig
from raymoe.errors import InvalidRequestError

_DTYPES = ("float32", "bfloat16", "float16")

@dataclass(frozen=True)
class EngineConfig:
    """Everything ``Engine(model, **options)`` accepts.

    Attributes:
        model: path of a Hugging Face model folder.
        dtype: ``"float32"`` (default, used for parity), ``"bfloat16"`` or ``"float16"``.
        seed: seed of the ranks' default sampling generator (unseeded requests).
        device: ``"cpu"`` or ``"cuda"``; ``None`` picks cuda when available.
        attention_backend: ``"torch_native"`` (CPU and GPU) or ``"flash_attn"`` (GPU: vLLM's flash-attention,
            ``vllm.vllm_flash_attn``, imported lazily; checked here, so a missing package or an unsupported
            ``dtype`` / ``page_size`` fails at config time; see ``raymoe.attention.flash_attn_provider``).
        ray_address: Ray cluster to join for world size > 1 (None: start a local one on 127.0.0.1).
        fanout: how a step reaches the ranks: ``"channel"`` (the step channel: one authenticated Unix socket per
            rank on the driver's machine, ``raymoe.actors.step_channel``; a rank that cannot reach it makes the
            engine use ``"remote"``), ``"compiled"`` (Ray Compiled Graph: shared-memory channels whose readers
            poll), ``"remote"`` (plain actor calls; also the fallback when a compiled graph cannot be built) or
            None: ``"channel"`` for CPU ranks, ``"compiled"`` for CUDA ranks. Served dp=2 ep=2 on 2 cores, an
            actor call cost the driver and each rank about 1 ms of CPU per step and the compiled graph's polling
            readers took CPU the ranks need (docs/performance.md).
        step_timeout_s: bound on one step across all ranks, seconds (a hung rank fails the step).
        cpu_threads: intra-op threads of each rank that computes on CPU in a served or multi-rank engine (None:
            ``(cores - 1) // ranks``, at least 1, leaving a core to the HTTP front end, the driver and Ray; on
            2 cores a second thread per rank halved served throughput). The offline single-rank ``Engine`` keeps
            torch's default.
        cpu_rank_nice: nice value (-20..19) of the thread that runs each CPU rank's steps in a multi-rank engine
            (``raymoe.actors.process_tuning.raise_step_thread_priority``; the ranks are gang-synchronized by their
            collectives, so a preempted rank stalls all of them). None: -10 where the process may raise its
            priority (root or CAP_SYS_NICE), else unchanged with a warning; 0 leaves it at the default. A
            one-rank engine and CUDA ranks are left alone.
        overlap: two-batch / single-batch overlap of MoE layers. graph: decode graph capture. moe_comm: the MoE
            all-to-all backend and mode.
    Raises:
        InvalidRequestError: a bad option (names it), including a GPU backend without CUDA or its package.
    """

    model: str
    dtype: str = "float32"
    seed: int = 0
    device: str | None = None
    attention_backend: str = "torch_native"
    ray_address: str | None = None
    fanout: str | None = None
    step_timeout_s: float = 300.0
    cpu_threads: int | None = None
    cpu_rank_nice: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    moe_comm: MoeCommConfig = field(default_factory=MoeCommConfig)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise InvalidRequestError("dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise InvalidRequestError("device", f"must be 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend not in ("torch_native", "flash_attn"):
            raise InvalidRequestError("attention_backend", f"unknown backend {self.attention_backend!r}")
        if self.cache.page_size is None:  # fill in the backend's default page size (a derived value, set once)
            page = 16 if self.attention_backend == "flash_attn" else 1
            object.__setattr__(self, "cache", dataclasses.replace(self.cache, page_size=page))
        if self.attention_backend == "flash_attn":
            from raymoe.attention.flash_attn_provider import check_flash_attn_config

            check_flash_attn_config(self.cache.page_tokens, self.dtype)
        if self.fanout not in (None, "channel", "remote", "compiled"):
            raise InvalidRequestError("fanout", f"must be 'channel', 'remote' or 'compiled', got {self.fanout!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InvalidRequestError("cpu_threads", f"must be >= 1, got {self.cpu_threads!r}")
        if self.cpu_rank_nice is not None and not -20 <= self.cpu_rank_nice <= 19:
            raise InvalidRequestError("cpu_rank_nice", f"must be in [-20, 19], got {self.cpu_rank_nice!r}")
        if self.step_timeout_s <= 0:
            raise InvalidRequestError("step_timeout_s", "must be > 0")
        from raymoe.gpu_backends import check_gpu_backends

        check_gpu_backends(self)

    @property
    def max_dispatch_tokens_per_rank(self) -> int:
        """Per-rank token bound of eager low-latency steps, tokens (``moe_comm.num_max_dispatch_tokens_per_rank``
        or ``max_running_requests``); decode-graph steps always fit (``raymoe.comm.a2a_plan``)."""
        return self.moe_comm.num_max_dispatch_tokens_per_rank or self.scheduler.max_running_requests
