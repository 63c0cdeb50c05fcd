"""``EngineConfig``: everything ``Engine(model, **options)`` accepts: its own options (declared here with
``raymoe.config.option``) and one record per group of options (cache, scheduler, parallel, overlap, graph, moe_comm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raymoe.config.eplb import EplbConfig
from raymoe.config.faults import FaultConfig
from raymoe.config.graph import GraphConfig
from raymoe.config.option import check_choice, option
from raymoe.config.parallel import MoeCommConfig, OverlapConfig, ParallelConfig
from raymoe.config.scheduling import CacheConfig, SchedulerConfig
from raymoe.config.speculative import SpeculativeConfig
from raymoe.config.startup import StartupConfig
from raymoe.errors import InvalidRequestError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""Values of ``EngineConfig.device``; a resolved config holds ``"cpu"`` or ``"cuda"`` (``EngineConfig.resolved``)."""

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""Values of ``EngineConfig.dtype``; a resolved config never holds ``"auto"``."""

FANOUTS = ("channel", "remote", "compiled")
"""How a step can reach the ranks (``EngineConfig.fanout``, ``raymoe.actors.executor.RayExecutor``)."""

GROUP_ACTORS_MIN_DP = 4
"""``group_schedulers="auto"`` runs each DP group's scheduler in its own process from this many CUDA DP groups on:
the driver's CPU per decode step grows with the groups' running requests (``raymoe bench driver-scale``) and must
fit inside one GPU step (a few ms) for overlap scheduling to hide it."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``Engine(model, **options)`` accepts; each option's help (its declaration) says what it means.

    Attributes:
        model: path of a Hugging Face model folder.
        cache, scheduler, parallel, overlap, graph, moe_comm, startup, eplb, faults, speculative: the option groups
            (``CacheConfig`` ...
    Raises:
        InvalidRequestError: a bad option (names it), including a GPU backend without CUDA or its package
            (``raymoe.platform.backends``, ``raymoe.platform.cuda.flash_attn_provider``).
    """

    model: str
    dtype: str = option("auto", choices=DTYPE_CHOICES,
                        help="weights and activations: float32 (used for parity), bfloat16, float16 or auto: bfloat16 "
                             "on CUDA, float32 on CPU (decided with the device, raymoe.config.device_defaults).")
    seed: int = option(0, help="seed of the ranks' default sampling generator (requests without a seed).")
    device: str = option(
        "auto", choices=DEVICE_CHOICES,
        help="where the ranks compute: cuda (one GPU per rank; start-up fails at once, naming CUDA, when the Ray "
             "cluster, or for a one-rank offline engine this process, has no GPU), cpu, or auto: cuda when the Ray "
             "cluster declares GPU resources and this process's torch is a CUDA build (a one-rank offline engine: "
             "when torch.cuda.is_available()), else cpu. Resolved once, in the process that starts the engine, before "
             "any actor starts (raymoe.cluster.device_choice); every per-device default follows from it.")
    attention_backend: str = option(
        "torch_native", choices=("torch_native", "flash_attn", "flashinfer_mla"),
        help="torch_native (CPU and GPU, every model), flash_attn (GPU, grouped-query models: vLLM's "
             "flash-attention, vllm.vllm_flash_attn) or flashinfer_mla (GPU, DeepSeek MLA models: FlashInfer's "
             "BatchMLAPagedAttentionWrapper, from flashinfer-python). The GPU ones are imported lazily and checked "
             "when the engine is configured, so a missing package or an unsupported dtype or page_size fails then "
             "(raymoe.platform.cuda.flash_attn_provider, flashinfer_mla_provider).")
    ray_address: str | None = option(
        None, flag="address", help="Ray cluster to join for world size > 1, e.g. ray://head:10001 or auto (None: "
                                   "start a local one on 127.0.0.1).")
    fanout: str | None = option(
        None, choices=FANOUTS,
        help="how a step reaches the ranks: channel (the step channel: one authenticated Unix socket per rank on the "
             "driver's machine, raymoe.actors.step_channel; a rank that cannot reach it makes the engine use "
             "remote), compiled (Ray Compiled Graph: shared-memory channels whose readers poll), remote (plain actor "
             "calls; also the fallback when a compiled graph cannot be built) or None: channel for CPU ranks, "
             "compiled for CUDA ranks (on 2 CPU cores an actor call cost the driver and each rank about 1 ms of CPU "
             "per step, and the compiled graph's polling readers took CPU the ranks need).")
    group_schedulers: str = option(
        "auto", choices=("auto", "driver", "actors"),
        help="where each DP group's scheduling, radix cache, KV allocation, result processing and output rows run: "
             "driver (in the driver's process, one loop for all groups; raymoe.actors.driver), actors (one process per "
             "DP group beside its ranks, which send the group's batches to its ranks and its rows to the front end; "
             "the driver only decides what every rank must agree on from one small record per group and step; "
             "raymoe.actors.hosted_driver) or auto: actors from GROUP_ACTORS_MIN_DP CUDA DP groups on, else driver "
             "(decided with the device).")
    step_timeout_s: float = option(300.0, help="bound on one step across all ranks, seconds (a hung rank fails the "
                                               "step).")
    cpu_threads: int | None = option(
        None, help="intra-op threads of each rank that computes on CPU in a served or multi-rank engine (None: "
                   "(cores - 1) // ranks, at least 1, leaving a core to the HTTP front end, the driver and Ray). The "
                   "offline single-rank Engine keeps torch's default.")
    cpu_rank_nice: int | None = option(
        None, help="nice value (-20..19) of the thread that runs each CPU rank's steps in a multi-rank engine "
                   "(raymoe.actors.process_tuning; the ranks are gang-synchronized by their collectives, so a "
                   "preempted rank stalls all of them). None: -10 where the process may raise its priority (root or "
                   "CAP_SYS_NICE), else unchanged with a warning; 0 leaves it. A one-rank engine and CUDA ranks are "
                   "left alone.")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    moe_comm: MoeCommConfig = field(default_factory=MoeCommConfig)
    startup: StartupConfig = field(default_factory=StartupConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        check_engine_options({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.cache.page_size is None:  # fill in the backend's default page size (a derived value, set once)
            page = 16 if self.attention_backend == "flash_attn" else 1
            object.__setattr__(self, "cache", dataclasses.replace(self.cache, page_size=page))
        from raymoe.platform.backends import check_attention_backend, check_gpu_backends

        check_attention_backend(self.attention_backend, self.cache.page_tokens, self.kernel_dtype)
        check_gpu_backends(self)
        if self.eplb.enable_eplb or self.eplb.ep_num_redundant_experts:
            if self.parallel.ep_size < 2:
                name = "enable_eplb" if self.eplb.enable_eplb else "ep_num_redundant_experts"
                raise InvalidRequestError(name, "expert-parallel load balancing needs ep_size > 1")
        if self.device == "cuda" and self.parallel.bundle_gpus is False:
            raise InvalidRequestError("bundle_gpus", "ranks that compute on CUDA need a GPU in their placement bundle")

    @property
    def resolved(self) -> bool:
        """Whether the device and every per-device default are decided (``raymoe.config.device_defaults``): what
        the driver and the ranks need; ``raymoe.cluster.device_choice.resolve_engine_config`` makes it so."""
        return (self.device in ("cpu", "cuda") and self.dtype != "auto" and self.overlap.enable_tbo is not None
                and self.fanout is not None and self.group_schedulers != "auto"
                and self.parallel.bundle_gpus is not None)

    @property
    def kernel_dtype(self) -> str:
        """The dtype the ranks will compute in as far as the options tell: ``dtype``, or for ``auto`` float32 on
        CPU and bfloat16 where the device may be CUDA (the only device GPU backends run on: what their checks
        need before the device is resolved)."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def max_dispatch_tokens_per_rank(self) -> int:
        """Per-rank token bound of eager low-latency steps, tokens (``moe_comm.num_max_dispatch_tokens_per_rank``
        or ``max_running_requests``, times ``speculative_num_steps + 1`` with speculation: a verify step carries that
        many tokens per request); decode-graph steps always fit (``raymoe.comm.a2a_plan``)."""
        return (self.moe_comm.num_max_dispatch_tokens_per_rank
                or self.scheduler.max_running_requests * self.speculative.tokens_per_request)


def check_engine_options(values: Mapping[str, Any]) -> None:
    """The checks of ``EngineConfig``'s own options that need only their values: the declared choices and the
    ranges. Names not in ``values`` are not checked; nothing about this machine (CUDA, packages) is looked at.

    Raises:
        InvalidRequestError: naming the first bad option.
    """
    for f in dataclasses.fields(EngineConfig):
        if f.name in values:
            check_choice(f, values[f.name])
    cpu_threads, nice = values.get("cpu_threads"), values.get("cpu_rank_nice")
    if cpu_threads is not None and cpu_threads < 1:
        raise InvalidRequestError("cpu_threads", f"must be >= 1, got {cpu_threads!r}")
    if nice is not None and not -20 <= nice <= 19:
        raise InvalidRequestError("cpu_rank_nice", f"must be in [-20, 19], got {nice!r}")
    if values.get("step_timeout_s", 1.0) <= 0:
        raise InvalidRequestError("step_timeout_s", "must be > 0")
