"""The records that cross the front end <-> driver channel: requests in (``AddRequest``), per-request output as a
front end's stream consumes it (``RequestDelta``, made from the rows of an ``raymoe.actors.output_batch.
OutputBatch``), why a request ended without a result (``RequestError``), and the engine's counters and health
(``EngineStats``).

Ownership: the ``DriverService`` (driver side) builds deltas and stats; the front end (``EngineClient``) reads them
and turns a ``RequestError`` into a typed exception. Plain data, picklable, no behaviour beyond that mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raymoe.actors.dp_router import RouteCounters
from raymoe.actors.step_timing import StepTimes
from raymoe.eplb.report import ExpertLoadReport
from raymoe.errors import EngineUnhealthyError, InvalidRequestError, RaymoeError, RequestFailedError
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.spec_steps import SpecCounters
from raymoe.step.kv_stream import KVStreamTarget
from raymoe.step.step_output import TokenLogprobs


@dataclass(frozen=True)
class RequestError:
    """Why a request ended without a result.

    Attributes:
        kind: ``"invalid"`` (refused or unrunnable as given; ``field`` names why, ``"queue"`` when full),
            ``"failed"`` (this request's part of a step failed; the engine serves the others), ``"unhealthy"``
            (the engine failed or is recovering) or ``"retracted"`` (taken off the engine for a weight update,
            ``retract_requests``: the front end submits it again with its tokens once the new weights serve).
        message: human readable reason (no tracebacks). field: the offending field for ``"invalid"``.

    Raises:
        ValueError: an unknown ``kind``.
    """

    kind: str
    message: str
    field: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("invalid", "failed", "unhealthy", "retracted"):
            raise ValueError(f"RequestError.kind must be 'invalid', 'failed', 'unhealthy' or 'retracted', got "
                             f"{self.kind!r}")

    def to_exception(self) -> RaymoeError:
        """The typed error a caller raises for this record."""
        if self.kind == "invalid":
            return InvalidRequestError(self.field or "request", self.message)
        if self.kind == "failed":
            return RequestFailedError(self.message)
        return EngineUnhealthyError(self.message)


@dataclass(frozen=True)
class RequestDelta:
    """New output of one request since its previous delta.

    Attributes:
        request_id: the caller's id.
        token_ids: tokens generated since the last delta. logprobs: one entry per token (None entries if not asked).
        finished: last delta of the request (also set with ``error``).
        finish_reason: ``"stop"`` | ``"length"`` | ``"abort"`` when finished normally, else ``None``.
        matched_stop: the stop string or token id that ended it, if any.
        prompt_tokens, completion_tokens, cached_tokens: usage counts so far (tokens).
        error: set when the request was refused or failed, or the engine failed (then ``finished``, no tokens).
        accepted_prediction_tokens, rejected_prediction_tokens: on the last delta, speculative decoding's draft
            tokens of the request the target accepted / rejected (0 without speculation).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, on the delta of the request's first output token:
            one entry per prompt token (the first None); else None.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: RequestError | None = None
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class AddRequest:
    """A request handed to the driver: the caller's id, prompt token ids and validated sampling parameters.

    ``output_ids`` resumes a request a fault interrupted (``raymoe.client.request_resume``): the tokens it had
    generated and streamed already. The engine re-prefills ``prompt_token_ids + output_ids`` and goes on from there:
    stop checks, ``max_tokens`` and a seeded request's draws (a function of seed and position) continue as if the
    request had never stopped, and its rows carry only the tokens after them.

    Prefill/decode disaggregation (``raymoe.client.pd_client``): ``export_kv`` asks a prefill engine to keep the
    prompt's KV locked when the request finishes, for the decode engine to fetch; ``kv_received`` tells a decode
    engine that the request's reservation (``Driver.reserve_kv``) now holds the prompt's KV, so the request joins the
    group that reserved it and computes only what follows the prompt (``output_ids`` holds the prefill's token).
    ``kv_stream`` (with ``export_kv``, when the engines' KV agents write one-sided): the prefill ranks write the
    prompt's KV into the decode engine's reservation layer by layer while they compute it
    (``raymoe.step.kv_stream``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_ids: tuple[int, ...] = ()
    export_kv: bool = False
    kv_received: bool = False
    kv_stream: KVStreamTarget | None = None


@dataclass(frozen=True)
class EngineStats:
    """Snapshot for metrics and health.

    Attributes:
        num_running, num_waiting: requests holding KV / queued (all DP groups).
        kv_usage: fraction of KV slots in use (max over groups; evictable cached prefixes count as free), 0..1.
        radix_hit_tokens: prompt tokens served from the radix cache so far.
        num_steps, num_tbo_steps: engine steps run, and those with two-batch overlap.
        healthy: the loop is alive and serving, and the ranks are up.
        step_seconds: forward + sampling seconds of the last step on each DP group's tp-rank 0.
        health_detail: why the engine is unhealthy ("" when healthy).
        rank_restarts: rank-group restarts after rank faults (never for a bad request).
        ep_shrinks, ep_grows: rank faults answered by shrinking onto the surviving DP groups, and returns to the
            full layout once replacement ranks started (``raymoe.actors.elastic_world``). dp_size: DP groups serving
            now (fewer than configured while shrunk). steps_shrunk: steps run while shrunk.
        loop_restarts: times the supervisor restarted a dead driver loop.
        failed_steps: steps a rank raised in (their requests failed, the ranks were kept).
        failed_requests: requests that ended with a ``"failed"`` error.
        kv_leaked_slots, req_rows_leaked, cache_tokens_locked: the idle invariant, measured the last time no
            request was in flight (KV slots neither free nor cached, ReqToTokenPool rows in use, radix-cache
            tokens still locked); all 0 when it holds. ``idle_checked``: whether it has been measured since the
            last request arrived (so the three counts describe the current idle state).
        step_times: histograms of the steps' period and ranks' forward time by mode (``step_timing``; the
            driver always fills it, with zero counts before the first step; None only in stats built elsewhere).
        expert_load: the expert-load window and balance (``raymoe.eplb``), when the ranks record expert load.
        routing: how new requests were routed to DP groups (``raymoe.actors.dp_router``), or None.
        spec: speculative decoding's counters summed over the groups (``raymoe.scheduler.spec_steps``), or None
            when it is off.
        weight_version: the name of the weights serving (``"default"`` until a weight update names one,
            ``raymoe.actors.weight_update``). weight_updates: weight updates applied so far.
    """

    num_running: int
    num_waiting: int
    kv_usage: float
    radix_hit_tokens: int
    num_steps: int
    num_tbo_steps: int
    healthy: bool
    step_seconds: list[float] = field(default_factory=list)
    health_detail: str = ""
    rank_restarts: int = 0
    ep_shrinks: int = 0
    ep_grows: int = 0
    dp_size: int = 1
    steps_shrunk: int = 0
    loop_restarts: int = 0
    failed_steps: int = 0
    failed_requests: int = 0
    kv_leaked_slots: int = 0
    req_rows_leaked: int = 0
    cache_tokens_locked: int = 0
    idle_checked: bool = False
    step_times: StepTimes | None = None
    expert_load: ExpertLoadReport | None = None
    routing: RouteCounters | None = None
    spec: SpecCounters | None = None
    weight_version: str = "default"
    weight_updates: int = 0
