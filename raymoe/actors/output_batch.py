"""OutputBatch: the outputs of one driver-loop iteration, in columns, the one message per step that reaches the
front end.

A row is one request that advanced, finished, was refused or failed: its id, how many new tokens it got, its output
length so far, and (for the last row of a request) how it ended. The tokens of every row are one flat list, and so
are their log-probabilities when any row asked for them. Columns of ints and strings pickle and unpickle many times
faster than one object per request, and the per-request objects the front end's streams consume
(:class:`~raymoe.actors.records.RequestDelta`) are made by the front end's reader, for its own streams only
(:meth:`OutputBatch.__iter__`).

Ownership: a group scheduler fills one per loop iteration (``raymoe.actors.group_scheduler``); the driver loop
merges the groups' and publishes; the front end iterates it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from raymoe.actors.records import RequestDelta, RequestError
from raymoe.step.step_output import TokenLogprobs


@dataclass(frozen=True)
class RequestEnd:
    """How a request ended (the last row of a request).

    Attributes:
        finish_reason: ``"stop"`` | ``"length"`` | ``"abort"`` (None with ``error``). matched_stop: the stop string or
            token id that ended it. prompt_tokens, cached_tokens: its usage counts (tokens). error: set when it was
            refused or failed (the row then carries no tokens). accepted_prediction_tokens,
            rejected_prediction_tokens: speculative decoding's draft tokens of the request the target accepted /
            rejected.
    """

    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: RequestError | None = None
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass
class OutputBatch:
    """Rows of one loop iteration (module docstring).

    Attributes:
        rids: the request of each row. counts: new tokens of each row. completion_tokens: each row's request's
            output tokens so far. token_ids: every row's new tokens, row after row. logprobs: one entry per token of
            ``token_ids`` (None entries for requests that asked none), or None when no row asked.
        ends: row -> how its request ended, for the rows that end a request.
        prompts: row -> the request's prompt log-probs (``SamplingParams.prompt_logprobs``), on the row of its
            first output token.
    """

    rids: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    ends: dict[int, RequestEnd] = field(default_factory=dict)
    prompts: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rids)

    def add(self, rid: str, tokens: list[int], completion_tokens: int,
            logprobs: list[TokenLogprobs | None] | None = None, end: RequestEnd | None = None,
            prompt_logprobs: list[TokenLogprobs | None] | None = None) -> None:
        """Append a row: ``tokens`` new, ``completion_tokens`` so far, ``logprobs`` one per token (None: not
        asked), ``end`` when it is the request's last row, ``prompt_logprobs`` on its first output token's."""
        if prompt_logprobs is not None:
            self.prompts[len(self.rids)] = prompt_logprobs
        if logprobs is not None and self.logprobs is None:
            self.logprobs = [None] * len(self.token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(logprobs if logprobs is not None else [None] * len(tokens))
        if end is not None:
            self.ends[len(self.rids)] = end
        self.rids.append(rid)
        self.counts.append(len(tokens))
        self.completion_tokens.append(completion_tokens)
        self.token_ids.extend(tokens)

    def add_next_tokens(self, rids: list[str], tokens: list[int], completion_tokens: list[int]) -> None:
        """Append one row per request that got exactly one new token and goes on (no end, no log-probabilities
        asked): ``rids[i]`` got ``tokens[i]`` and has ``completion_tokens[i]`` output tokens so far. The same rows
        as ``add(rids[i], [tokens[i]], completion_tokens[i])`` for each ``i``, in order."""
        if self.logprobs is not None:
            self.logprobs.extend([None] * len(tokens))
        self.rids.extend(rids)
        self.counts.extend([1] * len(rids))
        self.completion_tokens.extend(completion_tokens)
        self.token_ids.extend(tokens)

    def end(self, rid: str, end: RequestEnd) -> None:
        """Append a row that ends ``rid`` without tokens (refused, aborted, failed)."""
        self.add(rid, [], 0, end=end)

    def extend(self, other: OutputBatch) -> None:
        """Append ``other``'s rows after this batch's."""
        base = len(self.rids)
        if other.logprobs is not None and self.logprobs is None:
            self.logprobs = [None] * len(self.token_ids)
        if self.logprobs is not None:
            self.logprobs.extend(other.logprobs if other.logprobs is not None else [None] * len(other.token_ids))
        self.rids.extend(other.rids)
        self.counts.extend(other.counts)
        self.completion_tokens.extend(other.completion_tokens)
        self.token_ids.extend(other.token_ids)
        self.ends.update({base + row: e for row, e in other.ends.items()})
        self.prompts.update({base + row: p for row, p in other.prompts.items()})

    def __iter__(self) -> Iterator[RequestDelta]:
        """One :class:`RequestDelta` per row, in row order."""
        pos = 0
        for row, rid in enumerate(self.rids):
            n = self.counts[row]
            yield self.delta(row, rid, pos, n)
            pos += n

    def delta(self, row: int, rid: str, pos: int, n: int) -> RequestDelta:
        """Row ``row`` (``rid``, its tokens at ``token_ids[pos:pos + n]``) as a :class:`RequestDelta`."""
        logprobs = self.logprobs[pos:pos + n] if self.logprobs is not None else [None] * n
        end = self.ends.get(row)
        prompt = self.prompts.get(row) if self.prompts else None
        if end is None:
            return RequestDelta(rid, self.token_ids[pos:pos + n], logprobs,
                                completion_tokens=self.completion_tokens[row], prompt_logprobs=prompt)
        if end.error is not None:
            return RequestDelta(rid, [], finished=True, error=end.error)
        return RequestDelta(rid, self.token_ids[pos:pos + n], logprobs, finished=True,
                            finish_reason=end.finish_reason, matched_stop=end.matched_stop,
                            prompt_tokens=end.prompt_tokens, completion_tokens=self.completion_tokens[row],
                            cached_tokens=end.cached_tokens,
                            accepted_prediction_tokens=end.accepted_prediction_tokens,
                            rejected_prediction_tokens=end.rejected_prediction_tokens, prompt_logprobs=prompt)

    def ended_ids(self) -> list[str]:
        """The ids of the requests whose last row is in this batch (finished, aborted, refused or failed)."""
        return [self.rids[row] for row in self.ends]

    def split(self, owner: Callable[[str], str]) -> dict[str, OutputBatch]:
        """This batch's rows grouped by ``owner(rid)`` (a front end's id), each group's rows in row order, for a
        publisher that sends each front end only its own requests' rows."""
        parts: dict[str, OutputBatch] = {}
        pos = 0
        for row, rid in enumerate(self.rids):
            n = self.counts[row]
            key = owner(rid)
            part = parts.get(key)
            if part is None:
                part = parts[key] = OutputBatch()
            logprobs = self.logprobs[pos:pos + n] if self.logprobs is not None else None
            part.add(rid, self.token_ids[pos:pos + n], self.completion_tokens[row], logprobs, self.ends.get(row),
                     self.prompts.get(row))
            pos += n
        return parts

    def rows_for(self, wanted) -> Iterator[RequestDelta]:
        """The deltas of the rows whose request is in ``wanted`` (a container of ids), in row order: a front end
        builds objects for its own streams only."""
        pos = 0
        for row, rid in enumerate(self.rids):
            n = self.counts[row]
            if rid in wanted:
                yield self.delta(row, rid, pos, n)
            pos += n
