"""StepOutput: what a rank answers for one step (rank side -> driver side), with per-token log-probs.

Ownership: the rank's ``ModelRunner`` builds it; the scheduler applies it to its requests
(``Scheduler.process_batch_result``) and the front ends stream the :class:`TokenLogprobs` it carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (natural log) of one sampled token: its own and the ``k`` most likely alternatives
    (``top_token_ids`` and ``top_logprobs`` have ``k`` entries each, most likely first); ``rank``: for a prompt
    token's score, its 1-based rank in the vocabulary by probability (1 + the tokens more likely), else None."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """The scores of one prompt-scoring row of a step (``raymoe.step.prompt_scores``).

    Attributes:
        row: the row in the step's batch. first_token: the prompt index of the token ``scores[0]`` is about.
        scores: one entry per scored position: the log-probability of the prompt token that follows it (the
            tokens ``first_token, first_token + 1, ...``) and the top ``k`` there.
    """

    row: int
    first_token: int
    scores: tuple[TokenLogprobs, ...]


@dataclass(frozen=True)
class StepOutput:
    """What a rank answers for one step (only tp-rank 0 of each DP group answers with tokens).

    Attributes:
        next_token_ids: ``bs`` sampled token ids (for chunked-prefill rows that are not finished the driver
            discards them).
        logprobs: ``bs`` entries, ``None`` where the request asked for none.
        forward_seconds: wall time of forward + sampling on the rank, seconds.
        expert_load: the rank's cumulative routed pairs per MoE layer and logical expert, flattened [L * E]
            (``raymoe.eplb``; only when the step's ``ExpertUpdate.report_load`` asked), else None.
        grammar_done: rows whose grammar completed with this step's token (``raymoe.runner.grammar``): the request
            ends with ``stop`` after it.
        grammar_dead: rows whose grammar allowed no token: the token is discarded and the request ends
            (``abort``).
        accept_lens: for a TARGET_VERIFY step, ``bs`` counts of draft tokens each row accepted (its request gains
            those drafts, then ``next_token_ids[i]``); empty for every other step.
        draft_ids: with the MTP drafter (``nextn``), ``bs`` drafts for each row's next step (empty for a row that
            does not sample); empty otherwise.
        prompt_logprobs: the step's prompt scores, one entry per ``ModelWorkerBatch.prompt_score_rows`` row, in
            order; empty when it had none.
    Raises:
        ValueError: ``logprobs`` is neither empty nor one entry per token, or ``accept_lens`` is neither empty nor
            one count per row.
    """

    next_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    forward_seconds: float = 0.0
    expert_load: list[int] | None = None
    grammar_done: tuple[int, ...] = ()
    grammar_dead: tuple[int, ...] = ()
    accept_lens: tuple[int, ...] = ()
    draft_ids: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()

    def __post_init__(self) -> None:
        if any(not 0 <= p.row < len(self.next_token_ids) for p in self.prompt_logprobs):
            raise ValueError("StepOutput.prompt_logprobs names a row outside the step")
        if len(self.draft_ids) not in (0, len(self.next_token_ids)):
            raise ValueError(f"StepOutput.draft_ids has {len(self.draft_ids)} rows for {len(self.next_token_ids)}")
        if len(self.accept_lens) not in (0, len(self.next_token_ids)):
            raise ValueError(f"StepOutput.accept_lens has {len(self.accept_lens)} entries for "
                             f"{len(self.next_token_ids)} rows (expected none or one per row)")
        if len(self.logprobs) not in (0, len(self.next_token_ids)):
            raise ValueError(f"StepOutput.logprobs has {len(self.logprobs)} entries for "
                             f"{len(self.next_token_ids)} tokens (expected none or one per token)")
