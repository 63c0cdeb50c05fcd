"""ModelRunner: one rank's model shard, KV pools, attention backend and sampler.

Ownership: the runner is the only code that touches model tensors. It takes the driver's plain-data
``ModelWorkerBatch``, writes the request -> slot table, builds the ``ForwardBatch``, runs the model (eager or a
captured graph) and samples, answering with a ``StepOutput``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from raymoe.attention.base import get_attention_backend
from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.kvcache.pools import ReqToTokenPool, TokenToKVPool
from raymoe.models.loader import CheckpointReader
from raymoe.models.registry import get_model_class
from raymoe.runner.forward_batch import ForwardBatch
from raymoe.runner.sampler import Sampler
from raymoe.scheduler.model_worker_batch import ModelWorkerBatch, StepOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    """What a rank needs to build its runner (plain data, sent to each RankWorker).

    Attributes:
        model_path: Hugging Face folder. dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"``.
        num_kv_slots: KV slots of the pool (without dummy slot 0), tokens.
        max_req_rows: rows of the ReqToTokenPool table. max_context_len: tokens per row.
        attention_backend, a2a_backend: backend names. seed: sampler seed. device: ``"cpu"`` or ``"cuda"``.
    """

    model_path: str
    dtype: str
    num_kv_slots: int
    max_req_rows: int
    max_context_len: int
    attention_backend: str = "torch_native"
    a2a_backend: str = "torch"
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        if self.num_kv_slots < 1 or self.max_req_rows < 1 or self.max_context_len < 2:
            raise ValueError("num_kv_slots, max_req_rows must be >= 1 and max_context_len >= 2")


class ModelRunner:
    """Loads the rank's shard and runs steps.

    Raises:
        CheckpointError: the model folder is missing, truncated or does not match the architecture.
    """

    def __init__(self, cfg: RunnerConfig, groups: ParallelGroups | None = None):
        self.cfg = cfg
        self.groups = groups or ParallelGroups.single()
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.model_config = ModelConfig.from_hf(cfg.model_path)
        with CheckpointReader(cfg.model_path) as reader:
            model_cls = get_model_class(self.model_config.model_type)
            with torch.device(self.device):
                self.model = model_cls(self.model_config, self.groups, self.dtype, cfg.a2a_backend)
            self.model.load_weights(reader)
        self.model.eval()
        mc = self.model_config
        self.req_to_token_pool = ReqToTokenPool(cfg.max_req_rows, cfg.max_context_len, self.device)
        self.token_to_kv_pool = TokenToKVPool(cfg.num_kv_slots, mc.num_hidden_layers, self.model.num_local_kv_heads,
                                              mc.head_dim, self.dtype, self.device)
        self.attn_backend = get_attention_backend(
            cfg.attention_backend, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            num_heads=self.model.num_local_heads, num_kv_heads=self.model.num_local_kv_heads, head_dim=mc.head_dim)
        self.sampler = Sampler(cfg.seed, self.device)

    def prepare(self, batch: ModelWorkerBatch) -> ForwardBatch:
        """Write the slot table for ``batch`` and build its ForwardBatch with attention metadata."""
        fb = ForwardBatch.from_worker_batch(batch, self.device)
        if batch.forward_mode.is_extend():
            prefix_slots = torch.tensor(batch.prefix_slots, dtype=torch.int64, device=self.device)
            self.req_to_token_pool.write_extend(batch.req_pool_indices, batch.prefix_lens, batch.seq_lens,
                                                prefix_slots, fb.out_cache_loc)
        elif batch.forward_mode.is_decode():
            self.req_to_token_pool.write_decode(fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc)
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """Run the model. Returns float32 logits [bs, V] of each request's last token this step
        (``return_all_logits``: [T, V] for every token)."""
        hidden = self.model(fb)
        if not return_all_logits:
            hidden = hidden[fb.sample_indices]
        return self.model.compute_logits(hidden)

    @torch.no_grad()
    def forward_batch_generation(self, batch: ModelWorkerBatch) -> StepOutput:
        """One step: prepare, forward, sample. An IDLE batch runs the layers on zero tokens (so collectives
        match) and answers with no tokens."""
        t0 = time.perf_counter()
        fb = self.prepare(batch)
        logits = self.forward(fb)
        if fb.batch_size == 0:
            return StepOutput([], [], time.perf_counter() - t0)
        next_ids, logprobs = self.sampler(logits, fb.sampling)
        return StepOutput(next_ids.tolist(), logprobs, time.perf_counter() - t0)
