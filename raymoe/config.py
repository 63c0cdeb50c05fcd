"""Frozen configuration records.

``ModelConfig.from_hf`` normalizes Hugging Face ``config.json`` quirks (attribute aliases, ``rope_scaling`` vs
``rope_parameters``, missing ``head_dim``) in one place; everything below reads only the normalized fields.
``CacheConfig`` sizes the KV cache, ``SchedulerConfig`` the per-DP-group scheduler, ``EngineConfig`` is
what ``Engine(model, **options)`` accepts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raymoe.config_arch import MLAConfig, RouterConfig, deepseek_fields
from raymoe.errors import CheckpointError, InvalidRequestError
from raymoe.kvcache.paged_allocator import pool_slots

_DTYPES = ("float32", "bfloat16", "float16")


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only MoE model, normalized from a Hugging Face ``config.json``.

    Sizes are in elements; ``head_dim`` is per attention head (the rotary part for MLA, as transformers sets it).
    ``rope_parameters`` always has ``rope_type`` and ``rope_theta``. ``hf_config`` keeps the raw dict (used for RoPE
    scaling variants). ``mla`` is set for multi-head latent attention (DeepSeek-V2/V3); ``router`` says how experts
    are chosen; ``n_shared_experts`` shared experts of ``moe_intermediate_size`` each run on every token of a MoE
    layer. Dense layers are listed in ``mlp_only_layers`` whatever the family's own rule (normalized here).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    hf_config: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    mla: MLAConfig | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    n_shared_experts: int = 0

    def __post_init__(self) -> None:
        if self.n_shared_experts < 0:
            raise ValueError("n_shared_experts must be >= 0")
        if self.router.topk_method == "group_limited" and self.num_experts % self.router.n_group:
            raise ValueError("num_experts must be a multiple of n_group")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` has a sparse MoE block (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Normalize a Hugging Face config dict (Qwen3-MoE, Mixtral, DeepSeek-V2/V3 key names)."""
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        rope = dict(_first(d, "rope_parameters", "rope_scaling", default={}) or {})
        rope.setdefault("rope_theta", float(_first(d, "rope_theta", default=rope.get("rope_theta", 10000.0))))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        model_type = str(d.get("model_type", ""))
        # Qwen3-MoE: softmax top-k, renormalized iff norm_topk_prob; Mixtral always renormalizes.
        extra: dict[str, Any] = {"router": RouterConfig(
            norm_topk_prob=model_type == "mixtral" or bool(d.get("norm_topk_prob", False)))}
        if model_type in ("deepseek_v2", "deepseek_v3"):
            extra = deepseek_fields(d, rope, heads)
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(extra.pop("num_key_value_heads", _first(d, "num_key_value_heads", default=heads))),
            head_dim=int(extra.pop("head_dim", _first(d, "head_dim", default=hidden // heads))),
            intermediate_size=int(d.get("intermediate_size", 0)),
            moe_intermediate_size=int(_first(d, "moe_intermediate_size", default=d.get("intermediate_size", 0))),
            num_experts=int(_first(d, "num_experts", "num_local_experts", "n_routed_experts", default=0)),
            num_experts_per_tok=int(_first(d, "num_experts_per_tok", default=1)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(_first(d, "decoder_sparse_step", default=1)),
            mlp_only_layers=tuple(int(x) for x in extra.pop("mlp_only_layers", d.get("mlp_only_layers") or ())),
            rms_norm_eps=float(_first(d, "rms_norm_eps", default=1e-6)),
            rope_parameters=rope,
            max_position_embeddings=int(_first(d, "max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            eos_token_ids=eos_ids,
            hf_config=dict(d),
            **extra,
        )

    @classmethod
    def from_hf(cls, model_path: str | Path) -> "ModelConfig":
        """Read ``model_path/config.json``.

        Raises:
            CheckpointError: the folder or its config.json is missing or unreadable.
        """
        path = Path(model_path)
        cfg = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(str(path), "model folder does not exist")
        if not cfg.is_file():
            raise CheckpointError(str(cfg), "config.json is missing")
        try:
            d = json.loads(cfg.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(str(cfg), f"cannot parse config.json: {e}") from e
        gen = path / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text())
                if g.get("eos_token_id") is not None:
                    d = {**d, "eos_token_id": g["eos_token_id"]}
            except (OSError, json.JSONDecodeError):
                pass
        try:
            return cls.from_dict(d)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(str(cfg), f"unsupported or incomplete config: {e}") from e


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing for one DP-attention group.

    Attributes:
        max_total_tokens: KV slots (tokens) in the pool, not counting dummy slot 0; ``None``: derived from
            ``kv_cache_bytes`` by the engine.
        max_context_len: longest sequence (prompt + output) in tokens; also the width of ReqToTokenPool rows.
        enable_radix_cache: share KV of common prefixes between requests.
        page_size: tokens per KV page; slots are handed out in pages and a request's every aligned run of
            ``page_size`` positions lies in one page (``raymoe.kvcache.paged_allocator``; block-table kernels
            need it). ``None``: the attention backend's default, which ``EngineConfig`` fills in (1 for
            ``torch_native``, 16 for ``flash_attn``); a standalone ``CacheConfig`` reads it as 1
            (:attr:`page_tokens`). With pages the usable pool is ``max_total_tokens`` rounded down to whole pages.
    """

    max_total_tokens: int = 16384
    max_context_len: int = 2048
    enable_radix_cache: bool = True
    page_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_total_tokens < 2:
            raise InvalidRequestError("max_total_tokens", "must be >= 2")
        if self.max_context_len < 2:
            raise InvalidRequestError("max_context_len", "must be >= 2")
        if self.page_size is not None and (not isinstance(self.page_size, int) or self.page_size < 1):
            raise InvalidRequestError("page_size", f"must be a positive integer or None, got {self.page_size!r}")
        if self.max_total_tokens < self.page_tokens:
            raise InvalidRequestError("max_total_tokens", f"must hold at least one page ({self.page_tokens} tokens)")

    @property
    def page_tokens(self) -> int:
        """Tokens per KV page: ``page_size``, or 1 when unset."""
        return self.page_size or 1

    @property
    def kv_pool_slots(self) -> int:
        """KV slots each rank's pool allocates besides dummy slot 0: the allocator's pages plus the reserved
        page 0, so the pool is a whole number of pages (``max_total_tokens`` when ``page_tokens == 1``)."""
        return pool_slots(self.max_total_tokens, self.page_tokens)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-DP-group scheduling limits.

    Attributes:
        max_running_requests: most requests in one decode batch (also ReqToTokenPool rows).
        chunked_prefill_size: most prompt tokens prefilled in one step (longer prompts are chunked);
            ``None`` disables chunking (one prompt may then exceed ``max_prefill_tokens`` on its own).
        max_prefill_tokens: token budget of one prefill batch.
        schedule_policy: ``"fcfs"`` or ``"lpm"`` (longest prefix match first).
        max_queued_requests: waiting requests accepted before new ones are refused.
        enable_mixed_chunk: a prefill step also decodes every running request (``ForwardMode.MIXED``), so new
            prompts do not stall the running streams (SGLang's ``--enable-mixed-chunk``).
        disable_overlap_schedule: run the driver's steps one at a time. By default the driver forms and sends step
            N+1 while the ranks compute step N (zero-overhead scheduling; ``raymoe.actors.driver``); greedy
            outputs are the same either way.
    """

    max_running_requests: int = 64
    chunked_prefill_size: int | None = 512
    max_prefill_tokens: int = 4096
    schedule_policy: str = "fcfs"
    max_queued_requests: int = 4096
    enable_mixed_chunk: bool = True
    disable_overlap_schedule: bool = False

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise InvalidRequestError("max_running_requests", "must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise InvalidRequestError("chunked_prefill_size", "must be >= 1 or None")
        if self.max_prefill_tokens < 1:
            raise InvalidRequestError("max_prefill_tokens", "must be >= 1")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise InvalidRequestError("schedule_policy", "must be 'fcfs' or 'lpm'")
        if self.max_queued_requests < 1:
            raise InvalidRequestError("max_queued_requests", "must be >= 1")

    @property
    def req_pool_rows(self) -> int:
        """ReqToTokenPool rows a group needs (a chunk-prefilling request counts as running)."""
        return self.max_running_requests


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: ``world = dp_size * tp_size`` ranks.

    Attributes:
        tp_size: tensor-parallel ranks of attention/dense layers inside one DP-attention group.
        dp_size: DP-attention groups (each schedules its own requests; idle groups run IDLE batches).
        ep_size: expert-parallel ranks: the world size (experts sharded over every rank) or 1 (experts
            tensor-parallel inside each TP group).
        bundle_gpus: reserve one GPU per rank in its placement bundle (None: exactly when the ranks compute on
            CUDA). True with ``device="cpu"`` places ranks as on a GPU cluster while they compute on CPU, which is
            how a cluster of emulated GPU nodes (``ray.cluster_utils.Cluster`` with ``num_gpus``) is tested.
    """

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    bundle_gpus: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidRequestError(name, f"must be a positive integer, got {v!r}")
        if self.ep_size not in (1, self.world_size):
            raise InvalidRequestError("ep_size", f"must be 1 or the world size dp*tp={self.world_size}, "
                                                 f"got {self.ep_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size


@dataclass(frozen=True)
class OverlapConfig:
    """Compute/communication overlap of MoE layers (DESIGN section 4); every rank must use the same values.

    Attributes:
        enable_tbo: two-batch overlap; the driver decides per step whether it runs (``raymoe.overlap.decision``).
        tbo_min_tokens_decode: a DECODE step runs TBO only if its busiest DP group has at least this many tokens.
        tbo_min_tokens_extend: the same for EXTEND steps.
        tbo_token_distribution_threshold: an EXTEND split whose left token share lies outside
            ``[threshold, 1 - threshold]`` is replaced by the two-chunk split (one sequence cut across both halves).
        enable_sbo: single-batch overlap inside each MoE layer; mutually exclusive with ``enable_tbo``.
        tbo_decode_schedule: stage boundaries of a DECODE TBO step (``raymoe.overlap.strategy``): ``"fine"``
            (SGLang's five stages per MoE layer, child B two stages behind), ``"coarse"`` (the prefill schedule's
            three stages, children in step: each transfer overlaps a whole attention or expert stage of the other
            child), or ``"auto"``: coarse on CPU, fine on CUDA.
    """

    enable_tbo: bool = False
    tbo_min_tokens_decode: int = 16
    tbo_min_tokens_extend: int = 128
    tbo_token_distribution_threshold: float = 0.48
    enable_sbo: bool = False
    tbo_decode_schedule: str = "auto"

    def __post_init__(self) -> None:
        if self.enable_tbo and self.enable_sbo:
            raise InvalidRequestError("enable_sbo", "two-batch and single-batch overlap are mutually exclusive")
        for name in ("tbo_min_tokens_decode", "tbo_min_tokens_extend"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidRequestError(name, f"must be a positive integer, got {v!r}")
        if not 0.0 <= self.tbo_token_distribution_threshold <= 0.5:
            raise InvalidRequestError("tbo_token_distribution_threshold",
                                      f"must be in [0, 0.5], got {self.tbo_token_distribution_threshold!r}")
        if self.tbo_decode_schedule not in ("auto", "fine", "coarse"):
            raise InvalidRequestError("tbo_decode_schedule",
                                      f"must be auto, fine or coarse, got {self.tbo_decode_schedule!r}")


CPU_COMM_MODES = ("auto", "shm", "gloo")


@dataclass(frozen=True)
class MoeCommConfig:
    """How MoE layers move tokens between expert-parallel ranks (``raymoe.comm.dispatcher``); same on every rank.

    Attributes:
        a2a_backend: ``"torch"`` (``torch.distributed`` all-to-all: gloo on CPU, NCCL on GPU) or ``"deepep"``
            (DeepEP buffers; CUDA and the ``deep_ep`` package, checked here).
        a2a_mode: ``"normal"`` (data-dependent shapes, one host sync per layer for the row counts),
            ``"low_latency"`` (fixed shapes, counts stay on the device: capturable in decode graphs) or ``"auto"``
            (low-latency for decode steps, normal for steps with extend tokens; the driver resolves it per step,
            once for all ranks, ``raymoe.comm.a2a_plan``; on a single CPU rank, where nothing is dispatched,
            ``auto`` means normal: ``raymoe.comm.expert_input.effective_a2a_mode``).
        num_max_dispatch_tokens_per_rank: most tokens one rank may send in a low-latency step (sizes DeepEP's
            buffers); a step with more tokens on some rank runs in normal mode. None: ``max_running_requests``.
        cpu_comm: what carries the ``torch`` backend's all-to-all between CPU (gloo) ranks: ``"auto"`` (a
            shared-memory mapping when every EP rank is on one x86-64 node, ``raymoe.platform.cpu.shm``; else gloo),
            ``"shm"`` (shared memory or an error at start-up) or ``"gloo"``. Ignored on GPU.
    """

    a2a_backend: str = "torch"
    a2a_mode: str = "auto"
    num_max_dispatch_tokens_per_rank: int | None = None
    cpu_comm: str = "auto"

    def __post_init__(self) -> None:
        from raymoe.comm.expert_input import A2A_BACKENDS, A2A_MODES

        if self.a2a_backend not in A2A_BACKENDS:
            raise InvalidRequestError("a2a_backend", f"must be one of {A2A_BACKENDS}, got {self.a2a_backend!r}")
        if self.a2a_mode not in A2A_MODES:
            raise InvalidRequestError("a2a_mode", f"must be one of {A2A_MODES}, got {self.a2a_mode!r}")
        if self.cpu_comm not in CPU_COMM_MODES:
            raise InvalidRequestError("cpu_comm", f"must be one of {CPU_COMM_MODES}, got {self.cpu_comm!r}")
        m = self.num_max_dispatch_tokens_per_rank
        if m is not None and (not isinstance(m, int) or m < 1):
            raise InvalidRequestError("num_max_dispatch_tokens_per_rank", f"must be a positive integer, got {m!r}")


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
            ``dtype`` / ``page_size`` fails at config time; see ``raymoe.platform.cuda.flash_attn_provider``).
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
        from raymoe.platform.backends import check_attention_backend

        check_attention_backend(self.attention_backend, self.cache.page_tokens, self.dtype)
        if self.fanout not in (None, "channel", "remote", "compiled"):
            raise InvalidRequestError("fanout", f"must be 'channel', 'remote' or 'compiled', got {self.fanout!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InvalidRequestError("cpu_threads", f"must be >= 1, got {self.cpu_threads!r}")
        if self.cpu_rank_nice is not None and not -20 <= self.cpu_rank_nice <= 19:
            raise InvalidRequestError("cpu_rank_nice", f"must be in [-20, 19], got {self.cpu_rank_nice!r}")
        if self.step_timeout_s <= 0:
            raise InvalidRequestError("step_timeout_s", "must be > 0")
        from raymoe.platform.backends import check_gpu_backends

        check_gpu_backends(self)

    @property
    def max_dispatch_tokens_per_rank(self) -> int:
        """Per-rank token bound of eager low-latency steps, tokens (``moe_comm.num_max_dispatch_tokens_per_rank``
        or ``max_running_requests``); decode-graph steps always fit (``raymoe.comm.a2a_plan``)."""
        return self.moe_comm.num_max_dispatch_tokens_per_rank or self.scheduler.max_running_requests
