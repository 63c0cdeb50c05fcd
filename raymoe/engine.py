"""Engine: the Python API of raymoe (``from raymoe import Engine, SamplingParams``).

``Engine(model, **options)`` loads a Hugging Face MoE folder and serves ``generate`` calls. With world size 1 the
driver and the single rank run in this process; larger worlds run the rank actors on a Ray cluster.

``Engine(model, pd_prefill="dp=1", pd_decode="dp=2,ep=2", **options)`` runs prefill/decode disaggregation instead:
a prefill engine and a decode engine, each its own driver actor and ranks on Ray, the prompt's KV moved between them
(``raymoe.client.pd_client``, the same client ``raymoe serve --pd-prefill --pd-decode`` serves through).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from raymoe.actors.elastic_world import restart_ranks
from raymoe.actors.factory import build_driver
from raymoe.actors.records import RequestDelta
from raymoe.actors.weight_update import DEFAULT_WEIGHT_VERSION, WeightUpdate, WeightUpdateResult, apply_weight_update
from raymoe.client.blocking import BlockingClient, StreamRequest
from raymoe.cluster.device_choice import resolve_engine_config
from raymoe.config import EngineConfig, ModelConfig, engine_config_from_options
from raymoe.config.model_rules import apply_model_rules
from raymoe.errors import EngineUnhealthyError, InvalidRequestError
from raymoe.runner.grammar_compiler import compiler_for_model
from raymoe.scheduler.req import FinishKind, Req
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.step_output import TokenLogprobs
from raymoe.tokenizer import load_tokenizer


@dataclass(frozen=True)
class RequestOutput:
    """Result of one prompt.

    Attributes:
        request_id: the engine's id of the request.
        prompt_token_ids: prompt tokens. token_ids: generated tokens (including a final stop token).
        text: decoded generated text (special tokens skipped, cut before a matched stop string).
        finish_reason: ``"stop"`` or ``"length"`` (``"abort"`` for aborted requests; ``"error"`` for a request that
            failed alone inside the engine while the others went on).
        logprobs: per generated token, when requested.
        prompt_logprobs: per prompt token (the first None), with ``SamplingParams.prompt_logprobs``; else None.
        cached_tokens: prompt tokens served from the radix cache.
        accepted_prediction_tokens, rejected_prediction_tokens: speculative decoding's draft tokens the target
            accepted / rejected for this request (0 without speculation).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def _split_options(model: str, options: dict) -> EngineConfig:
    """The ``EngineConfig`` of flat ``options`` (``raymoe.config.engine_config_from_options``)."""
    return engine_config_from_options(model, options)


class Engine:
    """Offline generation engine.

    Args:
        model: path of a Hugging Face model folder.
        **options: flat engine options: every option field of ``EngineConfig`` and of its groups
            (``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig``, ``OverlapConfig``, ``GraphConfig``,
            ``MoeCommConfig``) by its field name, e.g. ``dtype="bfloat16", max_running_requests=32, dp_size=2``.
            Each is declared once, with its help, choices and default, in ``raymoe.config``;
            ``raymoe.config.engine_options()`` lists them and ``raymoe serve --help`` prints them. World size
            ``dp_size * tp_size`` > 1 runs the ranks as Ray actors, on ``ray_address`` or a local cluster.
        pd_prefill, pd_decode: prefill/decode disaggregation (both or neither): the prefill and the decode engine's
            layouts as ``raymoe bench compare`` takes them (``"dp=1"``, ``"dp=2,ep=2"``; ``raymoe.client.pd_config``),
            overriding the layout options for each side. Requests then run as a front end runs them: an engine
            fault is resumed by the clients, never seen by ``generate`` unless it outlasts their bounds.
        pd_kv_layerwise: in PD mode, the prefill ranks write the prompt's KV layer by layer while they compute it
            where the transfer writes one-sided (NIXL); False: after the prefill.

    Attributes:
        config: the resolved ``EngineConfig`` (device and per-device defaults decided: ``raymoe.config.
            device_defaults``; in PD mode the decode engine's). device_choice: the device and why
            (``raymoe.cluster.device_choice.DeviceChoice``). pd: the ``PDEngineClient`` in PD mode, else None.

    Raises:
        CheckpointError: missing or broken model folder. InvalidRequestError: a bad option (names it), including
            ``device="cuda"`` where no GPU is (this process for one rank, the Ray cluster for more).
        EngineUnhealthyError: the ranks did not start (e.g. a rank that sees no GPU: ``RankDeviceError``).
    """

    def __init__(self, model: str | Path, *, pd_prefill: str | None = None, pd_decode: str | None = None,
                 pd_kv_layerwise: bool = True, **options):
        self._closed = False
        self._unhealthy: str | None = None
        self.pd = self._blocking = None
        self.weight_version = DEFAULT_WEIGHT_VERSION  # the name of the weights serving (update_weights_from_disk)
        if pd_prefill is not None or pd_decode is not None:
            self._start_pd(str(model), pd_prefill, pd_decode, options, pd_kv_layerwise)
            return
        config = _split_options(str(model), options)
        self.model_config = ModelConfig.from_hf(model)
        config = apply_model_rules(config, self.model_config)  # what the model family cannot use
        cache = config.cache
        if cache.max_context_len > self.model_config.max_position_embeddings:
            config = dataclasses.replace(config, cache=dataclasses.replace(
                cache, max_context_len=self.model_config.max_position_embeddings))
        # The device, and every default that depends on it, is decided here, once, before any rank starts
        # (a multi-rank world joins Ray for it: the ranks' GPUs are the cluster's).
        self.config, self.device_choice = resolve_engine_config(config, serving=False)
        self.tokenizer = load_tokenizer(model)
        self.driver = build_driver(self.config, self.model_config, self.tokenizer, allow_hosted=False)

    def _start_pd(self, model: str, pd_prefill: str | None, pd_decode: str | None, options: dict,
                  layerwise: bool = True) -> None:
        """Start the prefill and the decode engine (``raymoe.client.pd_client``).

        Raises:
            InvalidRequestError: only one of ``pd_prefill`` / ``pd_decode``, a bad topology or option (names it).
        """
        from raymoe.client.pd_client import PDEngineClient
        from raymoe.client.pd_config import pd_engine_configs

        if pd_prefill is None or pd_decode is None:
            raise InvalidRequestError("pd_decode" if pd_decode is None else "pd_prefill",
                                      "prefill/decode disaggregation needs both pd_prefill and pd_decode")
        self.pd = PDEngineClient(*pd_engine_configs(model, options, pd_prefill, pd_decode), layerwise=layerwise)
        self._blocking = BlockingClient(self.pd)
        self.config, self.device_choice = self.pd.config, self.pd.device_choice
        self.model_config, self.tokenizer, self.driver = self.pd.model_config, self.pd.tokenizer, None

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
            raise EngineUnhealthyError("engine is shut down")
        if self._unhealthy is not None:
            self.recover()
        ids_list = self._prompt_ids(prompts, prompt_token_ids)
        params = self._params(sampling_params, len(ids_list))
        self._check_grammars(params)
        if self.pd is not None:
            reqs = [StreamRequest(f"pd-{uuid.uuid4().hex}", ids, p) for ids, p in zip(ids_list, params, strict=True)]
            return [self._stream_output(r, d) for r, d in zip(reqs, self._blocking.generate(reqs), strict=True)]
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
        # With overlap scheduling the last step sent may still be in flight once every request finished: wait
        # for it too, so that the engine is idle (every KV slot accounted for) between calls.
        while len(done) < len(rids) or self.driver.has_unfinished():
            try:
                updated = self.driver.step()
            except EngineUnhealthyError as e:
                self._unhealthy = str(e)
                self.driver.reset()
                raise
            for req in updated:
                if req.finished:
                    done[req.rid] = req
            if not self.driver.has_unfinished() and len(done) < len(rids):
                raise RuntimeError("scheduler went idle with unfinished requests")
        return [self._output(done[rid]) for rid in rids]

    def _check_grammars(self, params: list[SamplingParams]) -> None:
        """Compile each distinct output grammar once here, so a bad one is this call's ``InvalidRequestError``
        (naming its field) before any request starts (``raymoe.runner.grammar_compiler``)."""
        specs = {p.grammar for p in params if p.grammar is not None}
        if not specs:
            return
        mc = self.model_config
        compiler = compiler_for_model(str(self.config.model), mc.vocab_size, tuple(mc.eos_token_ids))
        for spec in specs:
            compiler.compile(spec)

    @property
    def healthy(self) -> bool:
        """False after a rank failed, until :meth:`recover` restarted the rank group."""
        return self._unhealthy is None and not self._closed

    def recover(self) -> None:
        """Restart the rank group after a failure (requests in flight were already failed).

        In PD mode the clients resume faults themselves: nothing to do.

        Raises:
            EngineUnhealthyError: the rank group could not be restarted.
        """
        if self.pd is not None:
            return
        restart_ranks(self.driver)
        self._unhealthy = None

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
        return out  # per-prompt checks (empty, length, vocabulary) are the driver's and scheduler's

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

    def _text(self, ids: Sequence[int], stopped_by: object) -> str:
        """The decoded text of ``ids``, cut before the stop string that ended it (if one did)."""
        text = self._detokenize(ids)
        if isinstance(stopped_by, str):
            cut = text.find(stopped_by)
            if cut >= 0:
                text = text[:cut]
        return text

    def _output(self, req: Req) -> RequestOutput:
        reason = req.finished_reason
        stopped_by = reason.matched if reason is not None and reason.kind == FinishKind.STOP else None
        logprobs = req.output_logprobs if req.sampling_params.logprobs is not None else None
        return RequestOutput(req.rid, list(req.origin_input_ids), list(req.output_ids),
                             self._text(req.output_ids, stopped_by), reason.kind.value if reason else "abort",
                             logprobs, req.cached_tokens, req.accepted_draft_tokens, req.rejected_draft_tokens,
                             list(req.prompt_logprobs) if req.sampling_params.prompt_logprobs is not None else None)

    def _stream_output(self, req: StreamRequest, deltas: list[RequestDelta]) -> RequestOutput:
        """The output of a request run through a client (PD mode): its deltas joined."""
        ids = [t for d in deltas for t in d.token_ids]
        last = deltas[-1]
        logprobs = [lp for d in deltas for lp in d.logprobs] if req.params.logprobs is not None else None
        prompt = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        return RequestOutput(req.request_id, list(req.prompt_token_ids), ids, self._text(ids, last.matched_stop),
                             last.finish_reason or "abort", logprobs, last.cached_tokens,
                             last.accepted_prediction_tokens, last.rejected_prediction_tokens, prompt)

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> WeightUpdateResult:
        """Serve ``model_path``'s weights from the next ``generate`` on (SGLang's ``update_weights_from_disk``;
        ``raymoe.actors.weight_update``): a folder of the served architecture, loaded by every rank in place; the
        radix cache is flushed. ``weight_version``: the name ``self.weight_version`` takes (None: kept).

        Returns:
            the result: ``success`` False with the reason (another architecture, naming the field; a tensor
            missing or misshapen, after which the ranks load the previous folder again) leaves the weights as
            they were.
        Raises:
            InvalidRequestError: prefill/decode mode (``pd_prefill``), where the two engines would have to switch
                together. EngineUnhealthyError: shut down, or the load and the reload of the previous folder both
                failed (the engine is unhealthy; :meth:`recover` rebuilds the ranks from the previous folder).
        """
        return self._update_weights(WeightUpdate(str(model_path), weight_version))

    def update_weights_from_tensors(self, tensors: Mapping[str, torch.Tensor],
                                    weight_version: str | None = None) -> WeightUpdateResult:
        """Serve ``tensors`` from the next ``generate`` on (SGLang's ``update_weights_from_tensor``): Hugging Face
        names -> tensors, every tensor of the served checkpoint (a ``state_dict`` of its ``transformers`` class,
        FP8 weights with their scales where it has them), loaded in place; the engine keeps the mapping, so ranks
        rebuilt after a fault load it again. As :meth:`update_weights_from_disk` otherwise.

        Returns:
            the result: ``success`` False (``param`` ``"tensors"``) for a tensor missing or misshapen (named), after
            which the ranks load the previous weights again.
        Raises:
            InvalidRequestError, EngineUnhealthyError: as :meth:`update_weights_from_disk`.
        """
        return self._update_weights(WeightUpdate(tensors=dict(tensors), weight_version=weight_version))

    def _update_weights(self, update: WeightUpdate) -> WeightUpdateResult:
        if self._closed:
            raise EngineUnhealthyError("engine is shut down")
        if self.pd is not None:
            raise InvalidRequestError("pd_prefill", "weight updates are not supported with prefill/decode "
                                                    "disaggregation")
        if self._unhealthy is not None:
            self.recover()
        try:
            result = apply_weight_update(self.driver, self.model_config, update, self.weight_version)
        except EngineUnhealthyError as e:
            self._unhealthy = str(e)
            raise
        self.weight_version = result.weight_version
        return result

    def shutdown(self) -> None:
        """Release the ranks; further calls raise."""
        if not self._closed:
            self._closed = True
            if self.pd is not None:
                self._blocking.shutdown()
            else:
                self.driver.executor.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
