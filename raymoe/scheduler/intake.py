"""Accepting, aborting and failing the requests of one DP group, outside the steps.

Ownership: part of the group's ``Scheduler``; works on its :class:`~raymoe.scheduler.group_state.GroupState`. A
request it accepts joins ``waiting`` (in order of acceptance) and ``unfinished``; one it aborts or fails leaves every
queue and gives its KV back at once. Requests finished while scheduling (not by a step) wait in
``finished_outside_step`` until :meth:`RequestIntake.drain`.
"""

from __future__ import annotations

import itertools

from raymoe.errors import InvalidRequestError
from raymoe.scheduler.group_state import GroupState
from raymoe.scheduler.req import FinishKind, Req, RequestFault
from raymoe.scheduler.request_rules import RequestLimits


class RequestIntake:
    """The group's door: checks and queues new requests, removes aborted and failed ones.

    Args:
        state: the group's state. limits: what a prompt must fit (context, vocabulary, KV pool).
        has_detokenizer: whether stop strings can be checked.
    """

    def __init__(self, state: GroupState, limits: RequestLimits, *, has_detokenizer: bool):
        self.state = state
        self.limits = limits
        self.has_detokenizer = has_detokenizer
        self._arrivals = itertools.count()

    def add(self, req: Req) -> None:
        """Queue a new request (it gets the next arrival number). A request that carries ``output_ids`` (resumed
        after a fault) waits like a retracted one: it re-prefills prompt + output and goes on.

        Raises:
            InvalidRequestError: the prompt breaks a rule of :class:`RequestLimits` (``"prompt"``), more
                log-probabilities than the vocabulary are asked for (``"logprobs"``), a ``logit_bias`` id outside the
                vocabulary (``"logit_bias"``); ``"stop"`` when it has stop
                strings and there is no detokenizer; ``"output_ids"`` when a resumed request's prompt + output
                breaks those rules or already reached ``max_tokens``; ``"rid"`` when a request with that id is
                unfinished or the request was scheduled before; ``"queue"`` when ``max_queued_requests`` requests
                are already waiting.
        """
        s = self.state
        self.limits.check_prompt(req.origin_input_ids)
        self.limits.check_logprobs(req.sampling_params.logprobs)
        self.limits.check_logprobs(req.sampling_params.prompt_logprobs, "prompt_logprobs")
        self.limits.check_logit_bias(req.sampling_params.logit_bias)
        if req.sampling_params.stop and not self.has_detokenizer:
            raise InvalidRequestError("stop", "stop strings need a detokenizer, and this scheduler has none")
        if req.rid in s.unfinished:
            raise InvalidRequestError("rid", f"a request with id {req.rid!r} is already in progress")
        if req.finished or req.kv_slots or req.req_pool_idx is not None:
            raise InvalidRequestError("rid", f"request {req.rid!r} was already scheduled")
        if req.output_ids:  # a resumed request: what it generated before must leave room to go on
            self.limits.check_prompt(req.fill_ids, field="output_ids")
            if len(req.output_ids) >= req.sampling_params.max_tokens:
                raise InvalidRequestError("output_ids", f"{len(req.output_ids)} tokens were generated already, "
                                                        f"max_tokens is {req.sampling_params.max_tokens}")
        if len(s.waiting) >= s.config.max_queued_requests:
            raise InvalidRequestError("queue", f"{len(s.waiting)} requests are already waiting")
        req.arrival = next(self._arrivals)
        s.waiting.append(req)
        s.unfinished[req.rid] = req

    def abort(self, rid: str) -> Req | None:
        """Remove an unfinished request wherever it is, release its KV and radix lock, finish it with ABORT (a
        batch in flight skips its row). Returns it, or ``None`` when ``rid`` is unknown or already finished."""
        req = self.state.unfinished.get(rid)
        if req is None:
            return None
        self.state.detach(req)
        req.finish(FinishKind.ABORT, message="aborted")
        return req

    def fail_inflight(self, fault: RequestFault) -> list[Req]:
        """The steps in flight failed on the ranks: fail each of their unfinished requests with ``fault`` (their
        KV is released, nothing is cached) and forget the batches. Cached prefixes are dropped too (with overlap
        scheduling a finished request may have cached a slot that only the failed step would have written).
        Returns the failed requests (not reported again by :meth:`drain`)."""
        s = self.state
        batches = list(s.inflight)
        s.inflight.clear()
        failed = list({id(r): r for b in batches for r in b.reqs if not r.finished}.values())  # each request once
        for req in failed:
            s.fail(req, fault, report=False)
        if batches:
            s.tree_cache.evict(s.tree_cache.evictable_size())
        return failed

    def drain(self) -> list[Req]:
        """Requests finished or failed while scheduling, not by a step; each is returned once."""
        s = self.state
        out, s.finished_outside_step = s.finished_outside_step, []
        return out
