"""ModelRunner: one rank's model shard, KV pools, attention backend and sampler.

Ownership: the runner is the only code that touches model tensors. It takes the driver's plain-data
``ModelWorkerBatch``, writes the request -> slot table, builds the ``ForwardBatch``, runs the model (eager or a
captured graph) and samples, answering with a ``StepOutput``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from raymoe.attention.tbo import TboAttnBackend
from raymoe.comm.dispatcher import A2ABackendSpec
from raymoe.comm.expert_input import resolve_a2a_mode
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.latency import inject_a2a_latency
from raymoe.config import ModelConfig, OverlapConfig
from raymoe.kvcache.pools import ReqToTokenPool
from raymoe.models.loader import CheckpointReader
from raymoe.models.registry import get_model_class
from raymoe.overlap.split import TboForwardBatchPreparer
from raymoe.overlap.strategy import resolve_decode_schedule
from raymoe.platform.interface import Platform
from raymoe.platform.selector import select_platform
from raymoe.runner.forward_batch import ForwardBatch
from raymoe.runner.future_tokens import FutureTokenMap
from raymoe.runner.graph_buckets import DEFAULT_MIN_KV_WIDTH, capture_sizes, kv_width_ladder
from raymoe.runner.sampler import Sampler
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}  # float64: exactness tests (e.g. graph replay vs eager)


@dataclass(frozen=True)
class RunnerConfig:
    """What a rank needs to build its runner (plain data, sent to each RankWorker).

    Attributes:
        model_path: Hugging Face folder. dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"`` (| ``"float64"``,
            for exactness tests).
        num_kv_slots: KV slots of the pool (without dummy slot 0), tokens.
        max_req_rows: rows of the ReqToTokenPool table. max_context_len: tokens per row.
        page_size: tokens per KV page the driver's allocator hands out (``CacheConfig.page_size``); the pool
            (``num_kv_slots + 1`` rows) must be a whole number of pages.
        attention_backend, a2a_backend: backend names (``flash_attn`` is checked here: package, dtype, page size).
            a2a_mode: the engine's MoE all-to-all mode (decode graphs capture the mode a decode step resolves to).
            num_max_dispatch_tokens_per_rank: per-rank token bound of low-latency dispatches (sizes DeepEP's
            buffers). seed: sampler seed. device: ``"cpu"`` or ``"cuda"``.
        disable_cuda_graph: run every decode eagerly (no capture at start-up). On CPU the "graphs" are
            static-buffer callables with the same contract (``raymoe.runner.graph_runner``).
        cuda_graph_max_bs: largest captured batch size (``None``: ``max_req_rows``).
        cuda_graph_bs: explicit batch sizes to capture (``None``: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to the max).
        cuda_graph_min_kv_width: first KV width, tokens, of the ladder each CUDA decode graph bucket is captured at
            (doubling up to ``max_context_len``; ``graph_buckets.kv_width_ladder``); a replay attends over the
            smallest width that holds its longest sequence. Raise it to capture fewer graphs; ``None``: one
            width (``max_context_len``). CPU ignores it (its replays narrow dynamically).
        enable_torch_compile: run each captured bucket's forward through ``torch.compile``.
        overlap: two-batch / single-batch overlap options (the engine's ``OverlapConfig``; same on every rank).
        inject_a2a_latency_ms: benchmarks only: delay each MoE dispatch/combine completion by this one-way
            latency, milliseconds (``raymoe.comm.latency``; 0 = off).
        cpu_threads: intra-op threads of a rank process on CPU (None: derived, see ``EngineConfig.cpu_threads``).
        cpu_rank_nice: nice value of a multi-rank engine's CPU rank step thread (``EngineConfig.cpu_rank_nice``;
            None: the default, -10).
        cpu_comm: EP all-to-all carrier between gloo ranks (``MoeCommConfig.cpu_comm``: auto, shm or gloo).
    """

    model_path: str
    dtype: str
    num_kv_slots: int
    max_req_rows: int
    max_context_len: int
    page_size: int = 1
    attention_backend: str = "torch_native"
    a2a_backend: str = "torch"
    a2a_mode: str = "auto"
    num_max_dispatch_tokens_per_rank: int = 256
    seed: int = 0
    device: str = "cpu"
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_min_kv_width: int | None = DEFAULT_MIN_KV_WIDTH
    enable_torch_compile: bool = False
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    inject_a2a_latency_ms: float = 0.0
    cpu_threads: int | None = None
    cpu_rank_nice: int | None = None
    cpu_comm: str = "auto"

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
        if self.cuda_graph_min_kv_width is not None and self.cuda_graph_min_kv_width < 1:
            raise ValueError(f"cuda_graph_min_kv_width must be >= 1 or None, got {self.cuda_graph_min_kv_width}")
        _ = self.graph_capture_sizes  # validates the graph options
        resolve_a2a_mode(self.a2a_mode, True)  # validates the mode

    @property
    def graph_capture_sizes(self) -> tuple[int, ...]:
        """Decode-graph buckets every rank captures, ascending (empty when disabled); the driver passes them to
        ``raymoe.runner.graph_buckets.plan_graph_bs``."""
        if self.disable_cuda_graph:
            return ()
        return tuple(capture_sizes(self.max_req_rows, self.cuda_graph_bs, self.cuda_graph_max_bs))

    @property
    def graph_kv_widths(self) -> tuple[int, ...]:
        """KV widths (tokens) every CUDA decode-graph bucket is captured at, ascending, ending at
        ``max_context_len`` (a rank-local choice per replay: only attention depends on it)."""
        return tuple(kv_width_ladder(self.max_context_len, self.cuda_graph_min_kv_width))


class ModelRunner:
    """Loads the rank's shard and runs steps.

    Args:
        cfg: the rank's settings. groups: its process groups (None: one rank).
        ops: the rank's platform, when its caller already chose it (the rank worker, which made the groups'
            transport with it); None: chosen here from ``cfg.device`` and ``cfg.dtype``
            (``raymoe.platform.selector.select_platform``).
    Raises:
        CheckpointError: the model folder is missing, truncated or does not match the architecture.
    """

    def __init__(self, cfg: RunnerConfig, groups: ParallelGroups | None = None, ops: Platform | None = None):
        self.cfg = cfg
        self.groups = groups or ParallelGroups.single()
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.ops = ops if ops is not None else select_platform(self.device, self.dtype)
        self.ops.tune_rank_memory()
        self.model_config = ModelConfig.from_hf(cfg.model_path)
        with CheckpointReader(cfg.model_path) as reader:
            model_cls = get_model_class(self.model_config.model_type)
            with torch.device(self.device):
                a2a = A2ABackendSpec(cfg.a2a_backend, cfg.a2a_mode, cfg.num_max_dispatch_tokens_per_rank)
                self.model = model_cls(self.model_config, self.groups, self.dtype, self.ops, a2a,
                                       enable_sbo=cfg.overlap.enable_sbo)
            self.model.load_weights(reader)
        self.model.eval()
        self.model.tbo_decode_schedule = resolve_decode_schedule(cfg.overlap.tbo_decode_schedule,
                                                                 self.ops.default_tbo_decode_schedule)
        if cfg.inject_a2a_latency_ms > 0:
            inject_a2a_latency(self.model, cfg.inject_a2a_latency_ms)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_req_rows, cfg.max_context_len, self.device, cfg.page_size)
        # The model knows its cache layout (per-head K/V, or the MLA latent) and the backend that reads it.
        self.token_to_kv_pool = self.model.create_kv_pool(cfg.num_kv_slots, self.dtype, self.device)

        def make_backend():
            return self.model.create_attn_backend(cfg.attention_backend, self.req_to_token_pool,
                                                  self.token_to_kv_pool)

        self.attn_backend = TboAttnBackend.create(make_backend) if cfg.overlap.enable_tbo else make_backend()
        self.sampler = Sampler(self.ops, cfg.seed, self.device)
        self.future_tokens = FutureTokenMap(cfg.max_req_rows, self.device)
        self.graph_runner = self.build_graph_runner() if cfg.graph_capture_sizes else None

    def build_graph_runner(self, kv_widths: Sequence[int] | None = None):
        """Capture the decode graphs of ``cfg.graph_capture_sizes`` (a ``GraphRunner``).

        Args:
            kv_widths: KV widths to capture, tokens. ``None``: ``cfg.graph_kv_widths`` where the platform's graphs
                fix their width (CUDA; the graph runner keeps only the table width for a backend whose kernels
                ignore it), else one recording per bucket, narrowed on replay. Explicit widths force fixed-width
                graphs, on CPU too (tests).
        """
        from raymoe.runner.graph_runner import GraphRunner

        cfg = self.cfg

        def tbo_prepare(fb: ForwardBatch) -> None:  # TBO buckets: the split of the padded batch
            TboForwardBatchPreparer.prepare(fb, cfg.overlap.tbo_token_distribution_threshold,
                                            self.attn_backend.children)

        capture = self.ops.graph_capture(self.device)
        if kv_widths is None and capture.fixed_kv_width:
            kv_widths = cfg.graph_kv_widths
        tbo = cfg.overlap.enable_tbo
        return GraphRunner(self.forward, self.attn_backend, cfg.graph_capture_sizes, capture, self.device,
                           max_kv_len=cfg.max_context_len, tbo_modes=(False, True) if tbo else (False,),
                           tbo_prepare=tbo_prepare if tbo else None, use_compile=cfg.enable_torch_compile,
                           low_latency=resolve_a2a_mode(cfg.a2a_mode, True) == "low_latency",
                           show_progress=self.groups.world_rank == 0, kv_widths=kv_widths)

    def prepare(self, batch: ModelWorkerBatch, for_graph: bool = False) -> ForwardBatch:
        """Write the slot table for ``batch`` and build its ForwardBatch with attention metadata and TBO children.
        ``for_graph``: only the table and tensors (a graph replay has its own metadata and its own TBO split of
        the padded batch)."""
        fb = ForwardBatch.from_worker_batch(batch, self.device)
        if batch.input_ids and min(batch.input_ids) < 0:  # overlap scheduling: tokens of the previous step
            fb.input_ids = self.future_tokens.resolve(fb.input_ids)
        if batch.forward_mode.is_extend():
            prefix_slots = torch.tensor(batch.prefix_slots, dtype=torch.int64, device=self.device)
            self.req_to_token_pool.write_extend(batch.req_pool_indices, batch.prefix_lens, batch.seq_lens,
                                                prefix_slots, fb.out_cache_loc, batch.table_lens)
        elif batch.forward_mode.is_decode():
            self.req_to_token_pool.write_decode(fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc)
        fb.attn_backend = self.attn_backend
        if for_graph:
            return fb
        if fb.use_tbo:  # two children with their own attention backends (raymoe.overlap.split)
            if not isinstance(self.attn_backend, TboAttnBackend):
                raise ValueError("batch.use_tbo is set but this rank was built without overlap.enable_tbo")
            TboForwardBatchPreparer.prepare(fb, self.cfg.overlap.tbo_token_distribution_threshold,
                                            self.attn_backend.children)
        self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """Run the model. Returns float32 logits [bs, V] of each request's last token this step
        (``return_all_logits``: [T, V] for every token)."""
        hidden = self.model(fb)
        if not return_all_logits:
            hidden = hidden[fb.sample_indices]
        # the decode dispatch capacity bounds every rank's rows alike (a DP-split LM head needs a shared bound)
        return self.model.compute_logits(hidden, fb.dispatch_capacity)

    @torch.inference_mode()
    def forward_batch_generation(self, batch: ModelWorkerBatch) -> StepOutput:
        """One step: prepare, forward, sample. An IDLE batch runs the layers on zero tokens (so collectives
        match) and answers with no tokens. With ``batch.graph_bs`` set and a matching capture, the forward is a
        graph replay of that bucket (an IDLE batch then replays it with padding rows only).

        Runs under ``torch.inference_mode`` (no version counters or view tracking: about 5-8 % less CPU per
        decode step than ``no_grad`` on the CI machine). Tensors a step creates and keeps (gather buffers) are
        only ever written by later steps, inside the same mode."""
        t0 = time.perf_counter()
        use_graph = self.graph_runner is not None and batch.graph_bs is not None and self.graph_runner.can_run(batch)
        fb = self.prepare(batch, for_graph=use_graph)
        logits = self.graph_runner.replay(fb) if use_graph else self.forward(fb)
        if fb.batch_size == 0:
            return StepOutput([], [], time.perf_counter() - t0)
        next_ids, logprobs = self.sampler(logits, fb.sampling)
        self.future_tokens.store(next_ids)
        return StepOutput(next_ids.tolist(), logprobs, time.perf_counter() - t0)
