"""One generation request as the scheduler sees it (driver side; plain Python, no tensors).

Ownership: the per-DP-group ``Scheduler`` owns every :class:`Req` it accepted; the driver reads ``output_ids``,
``output_logprobs`` and ``finished_reason`` to stream results. KV bookkeeping fields (``req_pool_idx``,
``kv_slots``, ``prefix_len``, ``last_node``) are changed only by the scheduler and its ``PrefillAdder``.

KV accounting (units are tokens, one KV slot per token): ``kv_slots[i]`` holds the keys/values of ``fill_ids[i]``.
Its first ``prefix_len`` entries belong to the radix cache (locked through ``last_node``), the rest to the request.
While a request decodes, ``len(kv_slots) == len(fill_ids) - 1``: the newest sampled token is fed by the next step.

Overlap scheduling (``raymoe.actors.driver``) builds step N+1 before step N's tokens are known. A row of a step in
flight that will sample a token gets a *placeholder* id in ``pending_ids`` (``-(row + 1)``: the rank reads that row
of its previous step's sampled ids, ``raymoe.runner.future_tokens``). The scheduler sees the request as if that
token were there (``sched_seq_len``, ``tokens``) and ``Scheduler.process_batch_result`` swaps the placeholder for
the real token. ``output_ids`` and ``fill_ids`` only ever hold real tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.scheduler.stop_limits import StopLimits
from raymoe.step.kv_stream import KVStreamTarget
from raymoe.step.step_output import TokenLogprobs

# A token decodes to at least one byte and a character takes at most four UTF-8 bytes, so the text of a stop
# string of n characters comes from at most 4 * n tokens; one more token gives the decoder its left context.
_STOP_WINDOW_TOKENS_PER_CHAR = 4


class FinishKind(str, Enum):
    """Why a request ended: a stop condition, a length limit, an abort (client or scheduler), or an error that
    concerns this request only (``FinishReason.fault`` says which)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class RequestFault:
    """Why one request failed while the engine went on serving the others.

    Attributes:
        kind: ``"invalid"`` (the request cannot be run as given; ``field`` names why) or ``"failed"`` (building,
            running or post-processing its part of a step raised; the details are in the driver's log).
        message: human readable reason, without tracebacks or host details.
        field: the offending field for ``"invalid"``.

    Raises:
        ValueError: ``kind`` is neither ``"invalid"`` nor ``"failed"``.
    """

    kind: str
    message: str
    field: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("invalid", "failed"):
            raise ValueError(f"RequestFault.kind must be 'invalid' or 'failed', got {self.kind!r}")


class RequestFaultError(Exception):
    """Raised while building a step when one request's part cannot be built; the scheduler fails that request
    only (``fault``) and builds the step without it.

    Attributes:
        req: the request at fault. fault: what to tell its client.
    """

    def __init__(self, req: Req, fault: RequestFault):
        self.req = req
        self.fault = fault
        super().__init__(f"request {req.rid!r}: {fault.message}")


@dataclass(frozen=True)
class FinishReason:
    """How a request finished.

    Attributes:
        kind: STOP, LENGTH, ABORT or ERROR.
        matched: for STOP, the stop token id or the stop string that matched; otherwise ``None``.
        message: human readable detail (why a LENGTH, ABORT or ERROR happened).
        fault: for ERROR, what went wrong with this request.
    """

    kind: FinishKind
    matched: int | str | None = None
    message: str = ""
    fault: RequestFault | None = None


@dataclass(eq=False)
class Req:
    """A request: prompt, sampling parameters, generated tokens and the KV it holds.

    Args:
        rid: request id, unique within a scheduler.
        origin_input_ids: prompt token ids.
        sampling_params: validated sampling parameters.

    Attributes:
        output_ids: generated token ids (kept across retraction).
        output_logprobs: one entry per generated token (``None`` where none was asked for).
        prompt_logprobs: with ``sampling_params.prompt_logprobs``, entry ``i`` for prompt token ``i`` as far as
            the ranks scored the prompt (entry 0 is None: the first token has no context); empty otherwise, and
            for a request created with output (resumed after a fault, or the decode side of PD: its first row,
            elsewhere, carried them).
        finished_reason: ``None`` while unfinished.
        req_pool_idx: ReqToTokenPool row while the request holds KV, else ``None``.
        kv_slots: KV slots of positions ``[0, len(kv_slots))`` of ``fill_ids`` (includes the current step's slots
            from the moment a batch is scheduled).
        prefix_len: leading entries of ``kv_slots`` shared from the radix cache (tokens).
        last_node: radix-cache node locked for that prefix, or ``None``.
        arrival: order in which the scheduler accepted the request (FCFS key).
        admit_seq: order of the latest admission into a prefill batch (retraction picks the latest first).
        cached_tokens: prompt tokens served from the radix cache, summed over admissions (metrics).
        num_retractions: times this request was pushed back to the waiting queue.
        pending_ids: placeholder ids (negative) of tokens that steps in flight will sample for this request, oldest
            first (at most one while scheduling; see the module docstring).
        table_len: leading positions of the request's ReqToTokenPool row that the ranks' table already holds
            (their slots are not sent again); 0 after every (re-)admission.
        limits: what ends the request in its group (``raymoe.scheduler.stop_limits``), set at each admission;
            ``None`` before the first.
        grammar_synced: the ranks hold this request's grammar matcher with every output token it has accepted
            (``raymoe.runner.grammar``): set once a sampling row sent them its ``output_ids``, cleared with its KV
            (a re-admitted request sends them again).
        export_kv: prefill side of PD disaggregation: when it finishes, its prompt's KV stays locked in the radix
            cache for a decode engine to fetch (``GroupState.kv_exports``) until released.
        kv_stream: prefill side of PD disaggregation with layer-by-layer streaming: where the ranks write its
            prompt's KV while they compute it (``raymoe.step.kv_stream``); None: not streamed.
        kv_stream_sent: prompt positions whose KV went into a streamed step so far (0 after every
            (re-)admission: a re-computed prompt streams again from its start).
        spec_drafts: the draft tokens the ranks' MTP layer proposed for its next step (``nextn``; empty without
            one), cleared with its KV.
        accepted_draft_tokens, rejected_draft_tokens: speculative decoding's draft tokens of this request the
            target accepted / rejected so far (usage: OpenAI's ``accepted_prediction_tokens`` /
            ``rejected_prediction_tokens``).
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list, repr=False)
    finished_reason: FinishReason | None = None
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    prefix_len: int = 0
    last_node: Any = None
    export_kv: bool = False
    kv_stream: KVStreamTarget | None = field(default=None, repr=False)
    kv_stream_sent: int = 0
    arrival: int = -1
    admit_seq: int = -1
    cached_tokens: int = 0
    num_retractions: int = 0
    pending_ids: list[int] = field(default_factory=list)
    table_len: int = 0
    grammar_synced: bool = False
    limits: StopLimits | None = field(default=None, repr=False)
    spec_drafts: list[int] = field(default_factory=list, repr=False)
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0

    def __post_init__(self) -> None:
        self.origin_input_ids = [int(t) for t in self.origin_input_ids]
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs and not self.output_ids:
            self.prompt_logprobs = [None]  # (a request resumed with output went out with its prompt's scores)

    @property
    def prompt_scored_to(self) -> int | None:
        """With prompt log-probs still missing, the first position whose logits the ranks must compute (the
        position before the first unscored prompt token): a radix-cache hit may cover no more than it. None when
        none is asked for or all are in."""
        n = len(self.prompt_logprobs)
        if not n or n >= len(self.origin_input_ids):
            return None
        return n - 1

    def add_prompt_logprobs(self, first: int, scores: Sequence[TokenLogprobs]) -> None:
        """Record the ranks' scores of prompt tokens ``first, first + 1, ...``; those already held are skipped (a
        retracted request's prompt is computed again)."""
        have = len(self.prompt_logprobs)
        if first > have:
            raise ValueError(f"prompt log-probs of {self.rid} from token {first}, but only {have} are held")
        self.prompt_logprobs.extend(scores[have - first:])

    @property
    def fill_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (what a (re-)prefill computes)."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """Tokens in ``fill_ids``."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def sched_seq_len(self) -> int:
        """Tokens the scheduler plans with: ``seq_len`` plus the tokens steps in flight will sample."""
        return len(self.origin_input_ids) + len(self.output_ids) + len(self.pending_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Positions ``[start, end)`` of the prompt, the output and then the placeholders of ``pending_ids``,
        without building the whole list (cheap for the one-token decode slice)."""
        p = len(self.origin_input_ids)
        if end <= p:
            return self.origin_input_ids[start:end]
        o = p + len(self.output_ids)
        if start >= o:
            return self.pending_ids[start - o : end - o]
        head = self.origin_input_ids[start:] if start < p else []
        out = self.output_ids[max(start - p, 0) : end - p]
        return head + out + (self.pending_ids[: end - o] if end > o else [])

    def length_capped(self, max_context_len: int, kv_pool_size: int) -> bool:
        """Whether the request finishes by a length limit once its pending tokens arrive, whatever they are
        (``max_tokens``, ``max_context_len`` or the KV pool; see :meth:`check_finished`): then it is not scheduled
        again."""
        if not self.pending_ids:
            return False
        n = self.sched_seq_len
        return (len(self.output_ids) + len(self.pending_ids) >= self.sampling_params.max_tokens
                or n >= max_context_len or n > kv_pool_size)

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is computed or scheduled (``len(kv_slots)``)."""
        return len(self.kv_slots)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record one sampled token (and its log-probabilities, if any)."""
        self.output_ids.append(int(token_id))
        self.output_logprobs.append(logprobs)

    def finish(self, kind: FinishKind, matched: int | str | None = None, message: str = "") -> None:
        """Mark the request finished (the first reason wins); placeholders of steps in flight are dropped."""
        self.pending_ids.clear()
        if self.finished_reason is None:
            self.finished_reason = FinishReason(kind, matched, message)

    def fail(self, fault: RequestFault) -> None:
        """Mark the request finished with an error (``FinishKind.ERROR``); the first reason wins."""
        self.pending_ids.clear()
        if self.finished_reason is None:
            self.finished_reason = FinishReason(FinishKind.ERROR, message=fault.message, fault=fault)

    def check_finished(self, eos_token_ids: Sequence[int], detokenize: Callable[[Sequence[int]], str] | None,
                       max_context_len: int, *, kv_pool_size: int | None = None) -> bool:
        """Check the stop conditions after a new token was appended; set ``finished_reason`` when one holds.

        Order: stop token (``stop_token_ids``, or EOS unless ``ignore_eos``), stop string (neither within the
        first ``min_tokens`` tokens), ``max_tokens``
        (LENGTH), ``max_context_len`` reached by prompt + output (LENGTH), a next decode step that would need
        more KV than the whole pool (LENGTH). Stop strings are searched in the text
        of a tail window of the output only (enough tokens to contain the longest stop string), so the cost per
        step does not grow with the output.

        Args:
            eos_token_ids: the model's end-of-sequence ids.
            detokenize: token ids -> text; needed only when the request has stop strings.
            max_context_len: longest sequence (prompt + output) in tokens.
            kv_pool_size: KV slots of the whole pool; the next decode step needs ``seq_len`` of them.

        Returns:
            whether the request is finished (also true if it already was).

        Raises:
            ValueError: the request has stop strings and ``detokenize`` is ``None``.
        """
        if self.finished_reason is not None:
            return True
        if not self.output_ids:
            return False
        params = self.sampling_params
        last = self.output_ids[-1]
        stoppable = len(self.output_ids) > params.min_tokens  # min_tokens: no stop token or string ends it yet
        if stoppable and (last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids)):
            self.finish(FinishKind.STOP, matched=last)
            return True
        if params.stop and stoppable:
            if detokenize is None:
                raise ValueError(f"request {self.rid!r} has stop strings but the scheduler has no detokenizer")
            window = _STOP_WINDOW_TOKENS_PER_CHAR * max(len(s) for s in params.stop) + 1
            text = detokenize(self.output_ids[-window:])
            for s in params.stop:
                if s in text:
                    self.finish(FinishKind.STOP, matched=s)
                    return True
        if len(self.output_ids) >= params.max_tokens:
            self.finish(FinishKind.LENGTH, message="max_tokens reached")
            return True
        if self.seq_len >= max_context_len:
            self.finish(FinishKind.LENGTH, message="max_context_len reached")
            return True
        if kv_pool_size is not None and self.seq_len > kv_pool_size:
            self.finish(FinishKind.LENGTH, message="the sequence outgrew the KV pool")
            return True
        return False

    def reset_kv(self) -> None:
        """Forget KV bookkeeping after the scheduler released it (retraction or finish)."""
        self.req_pool_idx = None
        self.kv_slots = []
        self.prefix_len = 0
        self.last_node = None
        self.table_len = 0
        self.grammar_synced = False
        self.spec_drafts = []
