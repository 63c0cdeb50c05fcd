"""Resuming a request that an engine fault interrupted: the front end's half of "a lost rank costs a pause".

Ownership: the :class:`~raymoe.client.engine_client.EngineClient` keeps one :class:`ResumableRequest` per stream it
serves. The front end is the one place that knows exactly which tokens a client has received, and it outlives every
engine fault (a rank killed, stopped or cut off with its node; the driver loop or the driver actor dying): the
driver's and the groups' request state may be gone with the fault, the stream's is not.

Mechanism (after SGLang's retraction, which re-prefills a request's prompt + output when it loses its KV): when a
request ends with an ``"unhealthy"`` error, the front end waits until the engine reports healthy again and submits
it once more with the tokens it streamed (``AddRequest.output_ids``). The engine re-prefills prompt + those tokens
on whichever DP group has room (radix hits where that prefix is cached) and its rows carry only the tokens after
them, so the client's stream goes on after a pause. ``max_tokens``, stop checks and a seeded request's draws
(``raymoe.runner.sampler.seeded_uniform``: a function of seed and position) continue as if nothing had happened;
greedy requests give the tokens of an undisturbed run.

A request is resumed at most ``FaultConfig.max_request_resumes`` times (a request that brings a rank down each
time it runs must not take the engine down forever) and waits at most ``request_resume_timeout_s`` for the engine
to recover; past either bound it ends with the fault's error. ``"invalid"`` and ``"failed"`` errors (this request's
own fault, or a step the ranks computed wrongly) are never resumed. A request ``"retracted"`` for a weight update
(``raymoe.actors.weight_update``, ``retract_requests``) is resumed the same way, without counting against that
bound: the engine holds it until the new weights serve, and its remaining tokens are theirs (SGLang's "retract"
pause of partial rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raymoe.actors.records import AddRequest, RequestDelta, RequestError
from raymoe.config.faults import FaultConfig
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.kv_stream import KVStreamTarget


@dataclass
class ResumableRequest:
    """One stream's request as the front end can submit it again.

    Attributes:
        request_id: the caller's id (kept across resumes: aborts and rows use it).
        prompt_token_ids: the prompt (token ids). params: its sampling parameters.
        output_ids: every token delivered to the stream so far, in order.
        resumes: times it was submitted again after a fault. retracts: times it was submitted again after a
            weight update retracted it.
        export_kv, kv_received, kv_stream: prefill/decode disaggregation (``AddRequest``); a resumed request no
            longer receives KV (its reservation went with the fault): it re-prefills like any resumed request; a
            resumed prefill no longer streams (the restarted ranks' agents are new): its KV moves after it.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    resumes: int = 0
    retracts: int = 0
    export_kv: bool = False
    kv_received: bool = False
    kv_stream: KVStreamTarget | None = None

    def add(self) -> AddRequest:
        """The record that (re-)submits it: the prompt and, after a fault, the tokens delivered so far."""
        first = self.resumes == 0 and self.retracts == 0
        return AddRequest(self.request_id, self.prompt_token_ids, self.params, tuple(self.output_ids),
                          export_kv=self.export_kv, kv_received=self.kv_received and first,
                          kv_stream=self.kv_stream if first else None)

    def delivered(self, delta: RequestDelta) -> None:
        """Note the tokens of a delta the stream is about to deliver."""
        self.output_ids.extend(delta.token_ids)

    def may_resume(self, error: RequestError, faults: FaultConfig) -> bool:
        """Whether the request is submitted again after ``error``: True for an engine fault (``"unhealthy"``) while
        resumes are left, or a retraction (``"retracted"``), if it has tokens left to generate; False (``error``
        ends it) otherwise."""
        if len(self.output_ids) >= self.params.max_tokens:
            return False
        return error.kind == "retracted" or (error.kind == "unhealthy" and self.resumes < faults.max_request_resumes)
