"""Speculative decoding steps of one DP group: draft, form the TARGET_VERIFY batch, apply what the ranks accepted.

Ownership: part of the group's ``Scheduler`` when ``speculative_algorithm`` is set; works on its
:class:`~raymoe.scheduler.group_state.GroupState`. Where the group would run a DECODE step, :meth:`SpecSteps.
verify_batch` asks each decoding request for a draft (``raymoe.scheduler.ngram``) and, when any has one, forms a
``ForwardMode.TARGET_VERIFY`` batch instead: every request's newest token and its draft, with KV slots for all of
them. The ranks accept the longest agreeing prefix of each draft and add one token of their own
(``raymoe.runner.spec_verify``); :func:`apply_verify_result` appends those tokens one by one (so a stop token, a stop
string or a length limit inside them ends the request exactly where plain decoding would), then gives back the
slots of the rejected drafts (``free_tail``), so the request's KV again ends one position before its newest token.

Rules that keep it exact and simple:

* A step that verifies drafts or runs the draft model's passes is formed from the previous step's result and its
  own result is applied before the next step is formed (a request's next positions depend on how many drafts were
  accepted, its next drafts on the passes). Between such steps overlap scheduling goes on: the driver forms a step
  while the one before runs, and a request whose token is still on its way (``pending_ids``) gets no draft. The
  driver waits for the running step first only when a group may draft (:meth:`SpecSteps.wants_fresh_tokens`).
* A step with a request that asks for log-probs runs as plain DECODE (the ranks report one position per row); so
  does a step where no request found a draft, and, with the adaptive draft policy
  (``raymoe.scheduler.spec_policy``), one whose drafts are not expected to pay for the verify step.
* Drafts never run past a request's length limit: a draft is at most ``output_cap - generated - 1`` tokens.
* KV: the decode slot of every request comes first (``make_room_for_decode`` made room for it); draft slots are
  taken from what is left and a draft is cut to the slots it got, so speculation never retracts a request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from raymoe.config.speculative import SpeculativeConfig
from raymoe.scheduler.group_state import GroupState
from raymoe.scheduler.ngram import SEARCH_WINDOW, propose_ngram
from raymoe.scheduler.req import FinishKind, Req, RequestFault
from raymoe.scheduler.results import (
    GRAMMAR_DEAD_END,
    StopRules,
    apply_prompt_scores,
    check_oldest,
    finish_in_group,
)
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.scheduler.spec_policy import EXPLORE_EVERY, PROBE_EVERY, DraftPolicy
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_output import StepOutput

log = logging.getLogger(__name__)

MAX_OVERLAP_BACKOFF = PROBE_EVERY
"""Most decode batches formed under overlap scheduling (tokens pending, so no drafts) between two looks for drafts
that gave no verify step (``SpecSteps.wants_fresh_tokens``)."""


@dataclass(frozen=True)
class SpecCounters:
    """Speculative decoding's counters of one group, or summed over groups (``/metrics``).

    Attributes:
        verify_steps: TARGET_VERIFY steps. draft_tokens: draft tokens verified. accepted_tokens: drafts accepted.
        accept_len_counts: verify rows with a draft (request-steps) that accepted ``j`` drafts, at index ``j``.
    """

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accept_len_counts: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0.0 before any draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @staticmethod
    def total(parts: Iterable[SpecCounters | None]) -> SpecCounters | None:
        """The sum of ``parts`` (None where every part is None)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        width = max(len(p.accept_len_counts) for p in parts)
        counts = [sum(p.accept_len_counts[j] for p in parts if j < len(p.accept_len_counts)) for j in range(width)]
        return SpecCounters(sum(p.verify_steps for p in parts), sum(p.draft_tokens for p in parts),
                            sum(p.accepted_tokens for p in parts), tuple(counts))


class SpecSteps:
    """Drafts and verify batches of one group (module docstring).

    Args:
        state: the group's state. config: the engine's speculative options (``enabled``).

    Attributes:
        num_verify_steps: TARGET_VERIFY steps formed. num_draft_tokens: draft tokens sent in them.
        num_accepted_tokens: draft tokens the ranks accepted. accept_len_counts: how many verify rows accepted
            ``j`` drafts, at index ``j`` (``speculative_num_steps + 1`` entries).
    """

    def __init__(self, state: GroupState, config: SpeculativeConfig):
        if not config.enabled:
            raise ValueError("SpecSteps needs speculative_algorithm")
        self.state = state
        self.config = config
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accept_len_counts = [0] * (config.speculative_num_steps + 1)
        self.policy = DraftPolicy() if config.speculative_draft_policy == "adaptive" else None
        self.ranks_draft = config.speculative_algorithm in ("nextn", "eagle")  # drafts from the ranks' draft model
        self._last_verified = True  # the last step's drafts were worth verifying
        self._steps_without_passes = 0
        self._since_evaluated = 0  # decode batches formed since drafts were last evaluated (no token pending)
        self._wanted = False  # the last look asked for a draft for some request
        self._overlap_for = 0  # decode batches to form with tokens pending before drafts are evaluated again
        self.hit_cut = 1 if self.ranks_draft else 0  # see ``PrefillAdder.hit_cut``

    def draft_for(self, req: Req, batch_size: int = 1) -> list[int]:
        """``req``'s draft for its next step in a step of ``batch_size`` rows (no placeholders may be pending),
        cut to its length limit and, with the adaptive policy, to the drafts that pay."""
        lim = req.limits
        cap = self.config.speculative_num_steps
        if lim is not None:
            cap = min(cap, lim.output_cap - len(req.output_ids) - 1)
        if self.policy is not None:
            cap = self.policy.draft_len(req.rid, cap, batch_size)
        if cap <= 0:
            return []
        self._wanted = True
        if self.ranks_draft:
            return req.spec_drafts[:cap]
        c = self.config
        out = req.output_ids
        tail = out[-SEARCH_WINDOW:] if len(out) >= SEARCH_WINDOW else \
            req.origin_input_ids[len(out) - SEARCH_WINDOW:] + out
        return propose_ngram(tail, cap, c.speculative_ngram_min_match_window_size,
                             c.speculative_ngram_max_match_window_size)

    def step_drafts(self, decoders: list[Req]) -> list[list[int]] | None:
        """Each decoding request's draft for this step, or None when the step should not verify any (a request with
        log-probs, penalties or a logit bias, no draft at all, or drafts the adaptive policy expects not to pay)."""
        if any(r.pending_ids for r in decoders):  # overlap scheduling: a token is still on its way
            self._since_evaluated += 1
            if self.policy is not None:  # a step without drafts, as the policy's probes and exploration count it
                self.policy.skip_step([r.rid for r in decoders])
            return None
        self._since_evaluated = 0
        self._overlap_for = min(max(1, 2 * self._overlap_for), MAX_OVERLAP_BACKOFF)  # unless it verifies, below
        for r in decoders:  # log-probs, penalties and biases are taken at the request's own tokens only
            if r.sampling_params.logprobs is not None or r.sampling_params.processes_logits:
                return None
        self._wanted = False
        drafts = [self.draft_for(r, len(decoders)) for r in decoders]
        if self.policy is not None:
            self.policy.prune(self.state.unfinished)
        if not any(drafts):
            if self._wanted:  # the policy wanted drafts and none was found: the next tokens may bring one
                self._overlap_for = 0
            return None
        if self.policy is not None and not self.policy.worth_verifying(
                [(r.rid, len(d)) for r, d in zip(decoders, drafts, strict=True)], len(decoders)):
            # drafts do not pay: the draft model's passes pause; a flipped (exploring) decision keeps them running,
            # the drafts still pay by the fits, and pausing them would cost EXPLORE_EVERY steps without drafts
            self._last_verified = self.policy.explored
            return None
        self._last_verified, self._overlap_for = True, 0
        return drafts

    def wants_fresh_tokens(self) -> bool:
        """Whether the next step may verify drafts or run the draft model's passes, and so must be formed from the
        result of the step before it (module docstring): with a draft model while its passes run
        (:meth:`wants_draft_passes`); with ``ngram`` and the fixed policy always; with the adaptive one right after a
        verify step or a look that wanted drafts and found none (the next tokens may bring a match), and after looks
        where drafting did not pay (no request's drafts worth it, a request that cannot verify in the batch) once
        1, 2, 4, ... up to :data:`MAX_OVERLAP_BACKOFF` decode batches overlapped (doubling with each such look).
        Overlapped batches count as plain-decoding steps for the policy's probes and exploration
        (``DraftPolicy.skip_step``), so it keeps measuring whether drafting pays. True right after this group formed
        a verify step or a step with draft passes: the driver relies on it to finish such a step before forming the
        next. With a draft model also True while a step holding draft-chain scratch slots is in flight: they sit at
        the tail of their requests' KV until its result is back (:meth:`release_scratch`), and a next step formed
        before then would put its slots after them."""
        if self.ranks_draft:
            return self.wants_draft_passes() or any(b.worker_batch.spec_scratch_slots for b in self.state.inflight)
        return self.policy is None or self._since_evaluated >= self._overlap_for

    def wants_draft_passes(self) -> bool:
        """Whether the ranks' draft model (``nextn`` / ``eagle``) should run after the step being planned: always
        with the fixed policy; with the adaptive one while the last drafts were worth verifying, and once every
        ``EXPLORE_EVERY`` steps otherwise (to learn when they are again). Skipped passes leave the draft model's
        KV without those positions: its later drafts are worse there, never the tokens."""
        if not self.ranks_draft:
            return False
        return self.policy is None or self._last_verified or self._steps_without_passes >= EXPLORE_EVERY

    def alloc_draft_slots(self, decoders: list[Req], drafts: list[list[int]]) -> None:
        """Append KV slots for each draft to its request (after its decode slot), cutting a draft to the slots the
        pool has (so speculation never retracts); counts the step as a verify step."""
        alloc = self.state.token_allocator
        for req, draft in zip(decoders, drafts, strict=True):
            if not draft:
                continue
            got = alloc.alloc(len(draft), req.kv_slots[-1])
            if got is None:  # pages: what the request's last page still holds, free of charge
                room = alloc.room_after(req.kv_slots[-1])
                del draft[room:]
                got = alloc.alloc(len(draft), req.kv_slots[-1]) if draft else []
            req.kv_slots.extend(got)
        self.num_verify_steps += 1
        self.num_draft_tokens += sum(map(len, drafts))

    def verify_batch(self, decoders: list[Req], alloc_decode_slots) -> ScheduleBatch | None:
        """A TARGET_VERIFY batch of ``decoders`` (room made for one decode slot each, none allocated yet), or None
        (nothing allocated) when the step should be a plain DECODE step (module docstring).

        Args:
            alloc_decode_slots: appends one decode slot to each of a list of requests (``BatchFormation``).
        """
        drafts = self.step_drafts(decoders)
        if drafts is None:
            return None
        alloc_decode_slots(decoders)
        self.alloc_draft_slots(decoders, drafts)
        return ScheduleBatch.build(decoders, ForwardMode.TARGET_VERIFY, [1 + len(d) for d in drafts], drafts)

    def counters(self) -> SpecCounters:
        """A snapshot of the counters."""
        return SpecCounters(self.num_verify_steps, self.num_draft_tokens, self.num_accepted_tokens,
                            tuple(self.accept_len_counts))

    def attach_draft_inputs(self, batch: ScheduleBatch) -> ScheduleBatch:
        """``batch`` with what the ranks' drafter needs (``nextn``, ``eagle``; ``raymoe.runner.mtp_drafter``): each
        row's next prompt token when it is a prefill chunk that does not sample (else -1), and
        ``speculative_num_steps - 1`` scratch KV slots per sampling row for the draft chain, appended to the
        request's ``kv_slots`` (its own tail: freed with it on any failure, and by :meth:`release_scratch` once
        the step's result is back). No scratch (drafts of one token) where the pool or a row's context is short, or
        where this group asks for no draft passes (:meth:`wants_draft_passes`: the chain will not run here)."""
        wb, ctx = batch.worker_batch, self.state.cache_config.max_context_len
        chain = self.config.speculative_num_steps - 1 if self.wants_draft_passes() else 0
        next_ids, samplers = [], []
        for req, partial, seq_len in zip(batch.reqs, batch.partial, wb.seq_lens, strict=True):
            if partial:
                next_ids.append(req.tokens(seq_len, seq_len + 1)[0])
            else:
                next_ids.append(-1)
                samplers.append((req, seq_len))
        scratch: list[int] = []
        if chain > 0 and samplers and all(n + chain <= ctx for _, n in samplers):
            alloc = self.state.token_allocator
            taken = []
            for req, _ in samplers:
                got = alloc.alloc(chain, req.kv_slots[-1])
                if got is None:
                    for r, slots in taken:
                        alloc.free_tail(slots)
                        del r.kv_slots[-len(slots):]
                    scratch = []
                    break
                req.kv_slots.extend(got)
                taken.append((req, got))
                scratch += got
        wb = dataclasses.replace(wb, spec_next_ids=tuple(next_ids), spec_scratch_slots=tuple(scratch))
        return dataclasses.replace(batch, worker_batch=wb)

    def release_scratch(self, batch: ScheduleBatch) -> None:
        """Give back the draft chain's scratch slots of ``batch`` (before its tokens are applied)."""
        chain = self.config.speculative_num_steps - 1
        if not batch.worker_batch.spec_scratch_slots:
            return
        scratch = batch.worker_batch.spec_scratch_slots
        k = 0
        for req, partial in zip(batch.reqs, batch.partial, strict=True):
            if partial:
                continue
            mine = list(scratch[k * chain:(k + 1) * chain])
            k += 1
            if req.req_pool_idx is not None and req.kv_slots[-chain:] == mine:
                self.state.token_allocator.free_tail(mine)
                del req.kv_slots[-chain:]

    def store_drafts(self, batch: ScheduleBatch, output: StepOutput) -> None:
        """Keep the ranks' drafts on the requests that go on (``Req.spec_drafts``); a step that ran no draft pass
        leaves its requests without drafts (the old ones were for an earlier position)."""
        if not self.ranks_draft:
            return
        ran = bool(output.draft_ids)  # the ranks answer a row per request when the step's draft passes ran
        self._steps_without_passes = 0 if ran else self._steps_without_passes + 1
        drafts_of = output.draft_ids or ((),) * batch.batch_size
        for req, drafts in zip(batch.reqs, drafts_of, strict=True):
            if req.finished_reason is None and req.req_pool_idx is not None:
                req.spec_drafts = list(drafts)

    def observe_step(self, batch: ScheduleBatch, output: StepOutput) -> None:
        """Feed a DECODE or TARGET_VERIFY step's cost to the draft policy (MIXED steps' cost is mostly prefill)."""
        mode = batch.worker_batch.forward_mode
        if self.policy is not None and (mode == ForwardMode.DECODE or mode == ForwardMode.TARGET_VERIFY):
            self.policy.observe_step(mode == ForwardMode.TARGET_VERIFY, batch.worker_batch.num_tokens,
                                     output.forward_seconds)

    def record(self, rid: str, drafts: int, accepted: int) -> None:
        """Count one verify row's outcome: ``accepted`` of ``drafts`` draft tokens (metrics, draft policy); a row
        without a draft (a MIXED step's prefill row, a request that found none) verified nothing."""
        if not drafts:
            return
        if self.policy is not None:
            self.policy.observe_row(rid, drafts, accepted)
        self.num_accepted_tokens += accepted
        self.accept_len_counts[min(accepted, len(self.accept_len_counts) - 1)] += 1


def verify_tokens(draft: Sequence[int], accepted: int, token: int) -> list[int]:
    """The tokens a verify row gives its request: the first ``accepted`` drafts, then the ranks' own ``token``.

    Raises:
        ValueError: ``accepted`` is outside ``[0, len(draft)]``.
    """
    if not 0 <= accepted <= len(draft):
        raise ValueError(f"a verify row accepted {accepted} of {len(draft)} draft tokens")
    return [*draft[:accepted], int(token)]


def trim_to_tokens(state: GroupState, req: Req) -> None:
    """Give back ``req``'s KV slots past the position before its newest token (the rejected drafts' and those of
    drafts after a token that ended it), so its KV matches its tokens again."""
    keep = len(req.origin_input_ids) + len(req.output_ids) - 1
    if len(req.kv_slots) > keep:
        state.token_allocator.free_tail(req.kv_slots[keep:])
        del req.kv_slots[keep:]
        req.table_len = min(req.table_len, keep)


def apply_verify_result(state: GroupState, batch: ScheduleBatch, output: StepOutput, stop: StopRules,
                        spec: SpecSteps) -> list[Req]:
    """Apply a TARGET_VERIFY step's result (``batch``, the oldest in flight): each row's accepted drafts and own
    token, appended one at a time with the stop checks of plain decoding after each, then its rejected slots given
    back (module docstring). A request whose checks raise fails alone, as in ``apply_batch_result``.

    Returns:
        the requests that got tokens (finished or not), in batch order.
    Raises:
        ValueError: ``batch`` is not the oldest batch in flight, or ``output`` lacks a token or an accepted count
            per row (nothing is changed then).
    """
    check_oldest(state, batch)
    bs = batch.batch_size
    if len(output.next_token_ids) != bs or len(output.accept_lens) != bs or batch.drafts is None:
        raise ValueError(f"a verify step's output needs {bs} tokens and accepted counts, got "
                         f"{len(output.next_token_ids)} and {len(output.accept_lens)}")
    state.inflight.popleft()
    apply_prompt_scores(state, batch, output)
    ctx, pool = state.cache_config.max_context_len, state.token_allocator.size
    out: list[Req] = []
    done, dead = output.grammar_done, output.grammar_dead  # constrained rows that end (usually none)
    rows = zip(batch.reqs, batch.partial, batch.drafts, output.accept_lens, output.next_token_ids, strict=True)
    for i, (req, partial, draft, accepted, token) in enumerate(rows):
        if req.finished_reason is not None or partial:  # a MIXED step's unfinished prefill chunk samples nothing
            continue
        try:
            tokens = verify_tokens(draft, accepted, token)
            if dead and i in dead:  # the grammar allows nothing after the accepted drafts: they stay, the token not
                tokens = tokens[:-1]
            spec.record(req.rid, len(draft), accepted)
            req.accepted_draft_tokens += accepted
            req.rejected_draft_tokens += len(draft) - accepted
            req.pending_ids.clear()
            finished = False
            for t in tokens:
                req.append_token(t)
                finished = req.check_finished(stop.eos_token_ids, stop.detokenize, ctx, kv_pool_size=pool)
                if finished:
                    break
            if req.req_pool_idx is not None:
                trim_to_tokens(state, req)
            if not finished and dead and i in dead:
                req.finish(FinishKind.ABORT, message=GRAMMAR_DEAD_END)
                finished = True
            elif not finished and done and i in done:  # the grammar completed with the row's own token
                req.finish(FinishKind.STOP, matched=tokens[-1])
                finished = True
        except Exception as e:  # noqa: BLE001 - this request's own check failed: fail it, keep the others
            log.exception("post-processing request %s failed", req.rid)
            state.fail(req, RequestFault("failed", f"applying the request's verified tokens failed "
                                                   f"({type(e).__name__})"), report=False)
            out.append(req)
            continue
        if finished:
            finish_in_group(state, req)
            if spec.policy is not None:
                spec.policy.forget(req.rid)
        out.append(req)
    return out
