"""ScheduleBatch: one step's requests as the scheduler decided them (driver side).

Ownership: built by the ``Scheduler`` after it has allocated the step's KV slots (they are already appended to
each request's ``kv_slots``); read back by ``Scheduler.process_batch_result``. It snapshots every number the
step needs at build time, so later changes to the requests (an abort, a retraction) cannot alter a batch that is
in flight. The step's numbers live in one record, the plain-data ``ModelWorkerBatch`` that ranks receive
(``ScheduleBatch.worker_batch``, built once by :meth:`ScheduleBatch.build`, or for most DECODE steps by
``raymoe.scheduler.decode_rows``, which gives the same record); the ScheduleBatch adds only what the scheduler
needs to apply the result (the requests, and which rows are unfinished prefill chunks). The set of decoding
requests itself is a plain list on the scheduler, not a batch object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.errors import InvalidRequestError
from raymoe.scheduler.req import Req, RequestFault, RequestFaultError
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.grammar import GrammarRow
from raymoe.step.kv_stream import KVStreamChunk
from raymoe.step.logit_penalties import LogitPenalties
from raymoe.step.prompt_scores import PromptScoreRow
from raymoe.step.sampling_inputs import SamplingRow
from raymoe.step.worker_batch import ModelWorkerBatch


@dataclass(frozen=True)
class ScheduleBatch:
    """Requests of one step and the step's record for the ranks (``bs`` requests).

    Attributes:
        reqs: the ``bs`` requests, in batch order.
        partial: ``bs`` flags, true for a prefill chunk that does not reach the end of ``fill_ids`` (its sampled
            token is discarded).
        worker_batch: the step as plain data (token ids, lengths, rows, KV slots, the sampling rows of newly
            admitted requests), EXTEND (prefill or a prefill chunk), DECODE, MIXED (prefill chunks and decode
            rows in one forward) or TARGET_VERIFY (each row's newest token and its draft tokens).
        drafts: for TARGET_VERIFY, each row's draft tokens (``raymoe.scheduler.spec_steps``); else None.
    Raises:
        ValueError: ``reqs``, ``partial``, ``drafts`` and ``worker_batch`` disagree on ``bs``.
    """

    reqs: list[Req]
    partial: list[bool]
    worker_batch: ModelWorkerBatch
    drafts: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if not len(self.reqs) == len(self.partial) == self.worker_batch.batch_size:
            raise ValueError(f"ScheduleBatch has {len(self.reqs)} requests, {len(self.partial)} partial flags and "
                             f"{self.worker_batch.batch_size} worker-batch rows")
        if self.drafts is not None and len(self.drafts) != len(self.reqs):
            raise ValueError(f"ScheduleBatch has {len(self.drafts)} drafts for {len(self.reqs)} requests")

    @classmethod
    def build(cls, reqs: Sequence[Req], forward_mode: ForwardMode, extend_lens: Sequence[int],
              drafts: Sequence[Sequence[int]] | None = None) -> ScheduleBatch:
        """Snapshot a step from request state whose ``kv_slots`` already end with this step's slots.

        For request ``r`` with extend length ``e``, the step computes positions ``[r.kv_len - e, r.kv_len)`` of
        its tokens (``r.tokens``: the prompt, the output, then placeholders of tokens still being sampled) into
        slots ``r.kv_slots[-e:]``. An EXTEND or MIXED step also carries the slots of positions
        ``[r.table_len, r.kv_len - e)`` that the ranks' table lacks. In a MIXED batch the decode rows
        (``e == 1``, prefix already on the ranks) follow the extend rows. A request's first row since its
        admission (``table_len == 0``) carries its ``SamplingRow`` (``ModelWorkerBatch.sampling_rows``); later ones
        carry none (``raymoe.step.sampling_table``). A TARGET_VERIFY row (``drafts`` given, one per request) computes
        its newest token and then its drafts: ``e = 1 + len(draft)``, with its ``kv_slots`` ending ``len(draft)``
        positions past its tokens.

        Raises:
            ValueError: ``forward_mode`` is IDLE, or the lengths (or ``drafts``) do not match the requests, or
                ``drafts`` is missing for TARGET_VERIFY or given for EXTEND or DECODE (a MIXED batch may carry
                drafts for its decode rows: empty for its prefill rows).
            RequestFaultError: one request's row cannot be built (a decode row has ``e != 1``, ``e < 1``, its KV
                would run past its tokens, it holds no ReqToTokenPool row, or its sampling parameters cannot be
                represented on the ranks); the caller fails that request and builds again without it.
        """
        if forward_mode == ForwardMode.IDLE:
            raise ValueError("ScheduleBatch builds EXTEND, MIXED and DECODE batches, not IDLE")
        if len(reqs) != len(extend_lens):
            raise ValueError("one extend length per request is required")
        if (drafts is None) == (forward_mode == ForwardMode.TARGET_VERIFY) and forward_mode != ForwardMode.MIXED or (
                drafts is not None and len(drafts) != len(reqs)):
            raise ValueError("drafts (one per request) go with TARGET_VERIFY batches (and may with MIXED ones)")
        decode = forward_mode == ForwardMode.DECODE
        input_ids: list[int] = []
        out_cache_loc: list[int] = []
        prefix_slots: list[int] = []
        prefix_lens: list[int] = []
        table_lens: list[int] = []
        partial: list[bool] = []
        grammar_rows: list[GrammarRow] = []
        sampling_rows: list[tuple[int, SamplingRow]] = []
        kv_streams: list[KVStreamChunk] = []
        scores: list[PromptScoreRow] = []
        for i, (req, e) in enumerate(zip(reqs, extend_lens, strict=True)):
            draft = drafts[i] if drafts is not None else ()
            end = req.kv_len - len(draft)  # the row's last position that holds a token of the request, + 1
            start = end - e + len(draft)
            total = req.sched_seq_len
            if e < 1 or start < 0 or end > total or (decode and e != 1) or (draft and end != total) or (
                    forward_mode == ForwardMode.TARGET_VERIFY and end != total):
                raise RequestFaultError(req, RequestFault(
                    "failed", f"bad extend length {e} for kv_len {end}, seq_len {total}"))
            if req.req_pool_idx is None:
                raise RequestFaultError(req, RequestFault("failed", "the request holds no KV row"))
            if req.table_len == 0:  # first step since (re-)admission: the ranks keep its numbers from here on
                sampling_rows.append((i, _checked_sampling_row(req)))
            input_ids += req.tokens(start, end)
            input_ids += draft
            out_cache_loc += req.kv_slots[start:end + len(draft)]
            if not decode:
                held = min(req.table_len, start)
                prefix_slots += req.kv_slots[held:start]
                table_lens.append(held)
            prefix_lens.append(start)
            if req.kv_stream is not None and not decode:
                chunk = _stream_chunk(req, end)
                if chunk is not None:
                    kv_streams.append(chunk)
            partial.append(end < total)  # never for a verify row (its tokens end at its newest)
            if not decode and req.prompt_scored_to is not None:
                score = _prompt_scores(i, req, start, end)
                if score is not None:
                    scores.append(score)
            spec = req.sampling_params.grammar
            if spec is not None and end == total:  # a row that samples: the rank masks it
                if req.grammar_synced:
                    grammar_rows.append(GrammarRow(i, req.rid))
                else:
                    grammar_rows.append(GrammarRow(i, req.rid, spec, tuple(req.output_ids),
                                                   req.sampling_params.ignore_eos))
        worker_batch = ModelWorkerBatch(
            forward_mode=forward_mode,
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
            prefix_lens=prefix_lens,
            extend_lens=list(extend_lens),
            out_cache_loc=out_cache_loc,
            prefix_slots=prefix_slots,
            table_lens=table_lens,
            grammar_rows=tuple(grammar_rows),
            sampling_rows=tuple(sampling_rows),
            draft_lens=() if drafts is None else tuple(len(d) for d in drafts),
            kv_streams=tuple(kv_streams),
            prompt_score_rows=tuple(scores),
        )
        return cls(reqs=list(reqs), partial=partial, worker_batch=worker_batch,
                   drafts=None if drafts is None else tuple(tuple(d) for d in drafts))

    def mark_scheduled(self) -> None:
        """Record on the requests that this batch is on its way to the ranks: their table rows will hold every
        position up to ``kv_len``, and each row that samples a token gets its placeholder (``-(row + 1)``)."""
        # Every row's sequence ends at its kv_len (``build``), so seq_lens holds the table lengths.
        rows = zip(self.reqs, self.worker_batch.seq_lens, self.partial, strict=True)
        for i, (req, kv_len, partial) in enumerate(rows, 1):
            req.table_len = kv_len
            if not partial:
                req.pending_ids.append(-i)
        for g in self.worker_batch.grammar_rows:  # the ranks now hold these matchers
            self.reqs[g.row].grammar_synced = True
        for req in self.reqs:
            if req.kv_stream is not None:
                req.kv_stream_sent = min(req.kv_len, len(req.kv_stream.dst_slots))  # (sent: [0, kv_len))

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return len(self.reqs)


def _stream_start(req: Req) -> int:
    """The first prompt position of ``req`` whose KV no streamed step has carried since its admission."""
    return 0 if req.table_len == 0 else req.kv_stream_sent


def _stream_chunk(req: Req, end: int) -> KVStreamChunk | None:
    """The rows a step computing ``req``'s positions up to ``end`` streams: every prompt position from the first
    not yet streamed (after a radix hit, the cached prefix too) to ``end``; None when they hold no prompt
    position."""
    target = req.kv_stream
    start, stop = _stream_start(req), min(end, len(target.dst_slots))
    if stop <= start:
        return None
    return target.chunk(req.kv_slots[start:stop], start, stop)


def _prompt_scores(row: int, req: Req, start: int, end: int) -> PromptScoreRow | None:
    """The prompt positions a step computing ``req``'s positions ``[start, end)`` scores (its prompt log-probs,
    ``raymoe.step.prompt_scores``): every one from ``start`` before the prompt's last (whose logits sample), or
    None when the chunk holds none. A re-computed prompt (retraction) scores its positions again; the request keeps
    the answers it holds."""
    prompt = req.origin_input_ids
    n = min(end, len(prompt) - 1) - start
    if n < 1:
        return None
    nxt = prompt[end] if start + n == end else -1
    return PromptScoreRow(row, int(req.sampling_params.prompt_logprobs), n, nxt, start + 1)


def _checked_sampling_row(req: Req) -> SamplingRow:
    """``req``'s numbers as the ranks keep them, re-checked (``SamplingParams.validate``: the bounds include what the
    ranks' float32/int64 tensors and generators hold) before its first row leaves the scheduler, so that a value
    changed after construction fails this one request instead of the whole step on every rank.

    Raises:
        RequestFaultError: kind ``"invalid"``, naming the field.
    """
    p = req.sampling_params
    try:
        p.validate()
    except InvalidRequestError as e:
        raise RequestFaultError(req, RequestFault("invalid", e.message, field=e.field)) from None
    penalties = None
    if p.processes_logits:  # the counts start from the whole prompt and output (raymoe.step.logit_penalties)
        stops = () if not p.min_tokens else tuple(sorted(
            req.limits.stop_ids if req.limits is not None else p.stop_token_ids))  # (limits: set on admission)
        penalties = LogitPenalties(float(p.presence_penalty), float(p.frequency_penalty), float(p.repetition_penalty),
                                   tuple((t, float(v)) for t, v in p.logit_bias),
                                   tuple(req.origin_input_ids) if p.repetition_penalty != 1.0 else (),
                                   tuple(req.output_ids), int(p.min_tokens), stops)
    return SamplingRow(float(p.temperature), float(p.top_p), int(p.top_k), float(p.min_p), p.seed, p.logprobs,
                       len(req.origin_input_ids), penalties)
