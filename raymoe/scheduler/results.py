"""Applying one step's sampled tokens to the requests of one DP group.

Ownership: part of the group's ``Scheduler``; works on its :class:`~raymoe.scheduler.group_state.GroupState`.
Results are applied oldest batch first. Each row's placeholder (``raymoe.scheduler.req``) becomes its token, the
stop conditions are checked, and a finished request caches its KV in the radix cache and frees its slots, row and
lock. With overlap scheduling a request finished by step N may have a row in step N+1: that row is skipped, so stop
tokens, stop strings and aborts take effect at the same token as without overlap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raymoe.scheduler.group_state import GroupState
from raymoe.scheduler.req import FinishKind, Req, RequestFault
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.step.step_output import StepOutput

GRAMMAR_DEAD_END = "the output's grammar allows no further token"
"""The message of a request ended (``abort``) because its grammar allowed no token (``StepOutput.grammar_dead``)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopRules:
    """What ends a request besides its own ``SamplingParams``.

    Attributes:
        eos_token_ids: the model's end-of-sequence token ids.
        detokenize: token ids -> text, for stop strings (``None``: requests with stop strings are refused).

    Raises:
        TypeError: ``detokenize`` is neither callable nor ``None``.
    """

    eos_token_ids: frozenset[int]
    detokenize: Callable[[Sequence[int]], str] | None = None

    def __post_init__(self) -> None:
        if self.detokenize is not None and not callable(self.detokenize):
            raise TypeError(f"detokenize must be callable or None, got {type(self.detokenize).__name__}")


def check_oldest(state: GroupState, batch: ScheduleBatch) -> None:
    """Raises ValueError unless ``batch`` is the oldest batch in flight (results are applied in launch order)."""
    if not state.inflight or batch is not state.inflight[0]:
        raise ValueError("process_batch_result: this batch is not the oldest one in flight")


def apply_batch_result(state: GroupState, batch: ScheduleBatch, output: StepOutput, stop: StopRules) -> list[Req]:
    """Apply the tokens of ``batch`` (the oldest batch in flight), ``output.next_token_ids`` [bs].

    A non-final prefill chunk's token is discarded. Rows of requests that finished or were aborted while the batch
    was in flight are skipped. A row whose grammar completed (``output.grammar_done``) ends with ``stop`` after
    its token; one whose grammar allowed no token (``output.grammar_dead``) ends with ``abort`` without it. A request
    whose own post-processing raises (its stop-string check, say) fails alone (``FinishKind.ERROR``, kind
    ``"failed"``, its KV released) and is returned with the others.

    Returns:
        the requests that got a new token (finished or not), in batch order.

    Raises:
        ValueError: ``batch`` is not the oldest batch in flight, or ``output`` has the wrong number of rows
            (nothing is changed then).
    """
    check_oldest(state, batch)
    if len(output.next_token_ids) != batch.batch_size:  # StepOutput itself checks logprobs against its tokens
        raise ValueError(f"StepOutput has {len(output.next_token_ids)} tokens for {batch.batch_size} requests")
    state.inflight.popleft()
    apply_prompt_scores(state, batch, output)
    ctx, pool = state.cache_config.max_context_len, state.token_allocator.size
    logprobs = output.logprobs or [None] * batch.batch_size
    out: list[Req] = []
    done, dead = output.grammar_done, output.grammar_dead  # constrained rows that end (usually none)
    rows = zip(batch.reqs, batch.partial, output.next_token_ids, logprobs, strict=True)
    for i, (req, partial, token, lp) in enumerate(rows):
        if req.finished_reason is not None or partial:
            continue
        if dead and i in dead:
            req.finish(FinishKind.ABORT, message=GRAMMAR_DEAD_END)
            finish_in_group(state, req)
            out.append(req)
            continue
        try:
            req.pending_ids.pop(0)
            outputs, token = req.output_ids, int(token)
            outputs.append(token)  # Req.append_token, inlined
            req.output_logprobs.append(lp)
            lim = req.limits  # the common token ends nothing: answered from the limits (``stop_limits``)
            if lim is None or lim.stop_strings or len(outputs) >= lim.output_cap or token in lim.stop_ids:
                finished = req.check_finished(stop.eos_token_ids, stop.detokenize, ctx, kv_pool_size=pool)
            else:
                finished = False
            if not finished and done and i in done:
                req.finish(FinishKind.STOP, matched=token)
                finished = True
        except Exception as e:  # noqa: BLE001 - this request's own check failed: fail it, keep the others
            log.exception("post-processing request %s failed", req.rid)
            state.fail(req, RequestFault("failed", f"checking the request's stop conditions failed "
                                                   f"({type(e).__name__})"), report=False)
            out.append(req)
            continue
        if finished:
            finish_in_group(state, req)
        out.append(req)
    return out


def apply_prompt_scores(state: GroupState, batch: ScheduleBatch, output: StepOutput) -> None:
    """File the step's prompt log-probs with their requests (``Req.add_prompt_logprobs``), before the rows' tokens:
    the request's first token then finds its prompt scored. A request whose answers do not fit what it holds fails
    alone."""
    for p in output.prompt_logprobs:
        req = batch.reqs[p.row]
        if req.finished_reason is not None:
            continue
        try:
            req.add_prompt_logprobs(p.first_token, p.scores)
        except ValueError as e:
            log.error("prompt log-probs of request %s: %s", req.rid, e)
            state.fail(req, RequestFault("failed", "its prompt log-probabilities came back out of order"))


def finish_in_group(state: GroupState, req: Req) -> None:
    """Take a request that just finished out of its group: its KV goes to the radix cache."""
    state.unfinished.pop(req.rid, None)
    if req in state.running:
        state.running.remove(req)
        state.release(req, cache=True)
    else:  # retracted while this batch was in flight: it holds no KV
        state.waiting.remove(req)
