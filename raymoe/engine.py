"""Engine: the Python API of raymoe (``from raymoe import Engine, SamplingParams``).

``Engine(model, **options)`` loads a Hugging Face MoE folder and serves ``generate`` calls. With world size 1 the
driver and the single rank run in this process; larger worlds run the rank actors on a Ray cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from raymoe.actors.driver import Driver
from raymoe.actors.rank_worker import RankWorker
from raymoe.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from raymoe.errors import CheckpointError, InvalidRequestError
from raymoe.runner.model_runner import RunnerConfig
from raymoe.scheduler.model_worker_batch import ModelWorkerBatch, StepOutput, TokenLogprobs
from raymoe.scheduler.req import FinishKind, Req
from raymoe.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestOutput:
    """Result of one prompt.

    Attributes:
        request_id: the engine's id of the request.
        prompt_token_ids: prompt tokens. token_ids: generated tokens (including a final stop token).
        text: decoded generated text (special tokens skipped, cut before a matched stop string).
        finish_reason: ``"stop"`` or ``"length"`` (``"abort"`` for aborted requests).
        logprobs: per generated token, when requested.
        cached_tokens: prompt tokens served from the radix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0


class LocalExecutor:
    """Runs the single rank in this process."""

    def __init__(self, worker: RankWorker):
        self.worker = worker

    def execute(self, batches: list[ModelWorkerBatch]) -> list[StepOutput]:
        return [self.worker.step(batches[0])]


def _split_options(model: str, options: dict) -> EngineConfig:
    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    top_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "cache", "scheduler"}
    cache, sched, top = {}, {}, {}
    for k, v in options.items():
        if k in cache_fields:
            cache[k] = v
        elif k in sched_fields:
            sched[k] = v
        elif k in top_fields:
            top[k] = v
        else:
            raise InvalidRequestError(k, "unknown engine option")
    return EngineConfig(model=model, cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **top)


class Engine:
    """Offline generation engine.

    Args:
        model: path of a Hugging Face model folder.
        **options: fields of ``EngineConfig`` (``dtype``, ``seed``, ``device``, ``attention_backend``),
            ``CacheConfig`` (``max_total_tokens``, ``max_context_len``, ``enable_radix_cache``) and
            ``SchedulerConfig`` (``max_running_requests``, ``chunked_prefill_size``, ``max_prefill_tokens``,
            ``schedule_policy``, ``max_queued_requests``).

    Raises:
        CheckpointError: missing or broken model folder. InvalidRequestError: a bad option (names it).
    """

    def __init__(self, model: str | Path, **options):
        self.config = _split_options(str(model), options)
        self.model_config = ModelConfig.from_hf(model)
        cache = self.config.cache
        if cache.max_context_len > self.model_config.max_position_embeddings:
            self.config = dataclasses.replace(self.config, cache=dataclasses.replace(
                cache, max_context_len=self.model_config.max_position_embeddings))
        self.tokenizer = _load_tokenizer(model)
        eos = self.model_config.eos_token_ids or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id
                                                  is not None else ())
        device = self.config.device or "cpu"
        runner_cfg = RunnerConfig(
            model_path=str(model), dtype=self.config.dtype, num_kv_slots=self.config.cache.max_total_tokens,
            max_req_rows=self.config.scheduler.req_pool_rows, max_context_len=self.config.cache.max_context_len,
            attention_backend=self.config.attention_backend, seed=self.config.seed, device=device)
        self._executor = LocalExecutor(RankWorker(runner_cfg))
        self.driver = Driver(self.config, self._executor, eos, self._detokenize)
        self._closed = False

    def _detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Tokenize ``text`` (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt, batched continuously; outputs follow the input order.

        Raises:
            InvalidRequestError: no prompt, an empty prompt, a prompt longer than the context, a sampling
                parameter out of range, or a sampling_params list of the wrong length (names the field).
        """
        if self._closed:
            raise RuntimeError("engine is shut down")
        ids_list = self._prompt_ids(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(ids_list))
        rids = []
        try:
            for ids, p in zip(ids_list, params, strict=True):
                rid = self.driver.new_rid()
                self.driver.add_request(rid, ids, p)
                rids.append(rid)
        except Exception:
            for rid in rids:
                self.driver.abort_request(rid)
            raise
        done: dict[str, Req] = {}
        while len(done) < len(rids):
            for req in self.driver.step():
                if req.finished:
                    done[req.rid] = req
            if not self.driver.has_unfinished() and len(done) < len(rids):
                raise RuntimeError("scheduler went idle with unfinished requests")
        return [self._output(done[rid]) for rid in rids]

    def _prompt_ids(self, prompts, prompt_token_ids) -> list[list[int]]:
        if prompts is not None and prompt_token_ids is not None:
            raise InvalidRequestError("prompt", "give either prompts or prompt_token_ids, not both")
        if prompt_token_ids is not None:
            out = [list(map(int, p)) for p in prompt_token_ids]
        elif prompts is not None:
            items = [prompts] if isinstance(prompts, str) else list(prompts)
            if any(not isinstance(p, str) for p in items):
                raise InvalidRequestError("prompt", "prompts must be strings")
            out = [self.encode(p) for p in items]
        else:
            raise InvalidRequestError("prompt", "no prompt given")
        if not out:
            raise InvalidRequestError("prompt", "no prompt given")
        vocab = self.model_config.vocab_size
        for ids in out:
            if not ids:
                raise InvalidRequestError("prompt", "prompt is empty")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequestError("prompt", f"token ids must be in [0, {vocab})")
            if len(ids) >= self.config.cache.max_context_len:
                raise InvalidRequestError("prompt", f"prompt has {len(ids)} tokens; the context holds "
                                                    f"{self.config.cache.max_context_len} (prompt + output)")
        return out

    @staticmethod
    def _params(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError("sampling_params", f"{len(params)} given for {n} prompts")
        return params

    def _output(self, req: Req) -> RequestOutput:
        reason = req.finished_reason
        text = self._detokenize(req.output_ids)
        if reason is not None and reason.kind == FinishKind.STOP and isinstance(reason.matched, str):
            cut = text.find(reason.matched)
            if cut >= 0:
                text = text[:cut]
        logprobs = req.output_logprobs if req.sampling_params.logprobs is not None else None
        return RequestOutput(req.rid, list(req.origin_input_ids), list(req.output_ids), text,
                             reason.kind.value if reason else "abort", logprobs, req.cached_tokens)

    def shutdown(self) -> None:
        """Release the ranks; further calls raise."""
        self._closed = True
        self._executor.worker = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _load_tokenizer(model: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError) as e:
        raise CheckpointError(str(model), f"cannot load the tokenizer: {e}") from e
