"""Prompt log-probabilities: which positions of a step the ranks score, and what they answer (driver <-> rank).

A request with ``SamplingParams.prompt_logprobs`` gets, for every prompt token after the first, the natural-log
probability the model gives it after the tokens before it, and the top ``k`` tokens there (vLLM's
``prompt_logprobs``; OpenAI's legacy completions return them with ``echo`` and ``logprobs``). The logits at a
position predict the token after it, so a prefill chunk of ``n`` positions scores the ``n - 1`` tokens after its
first inside the chunk and, when the prompt goes on past the chunk, the next chunk's first token, which the driver
sends (:attr:`PromptScoreRow.next_token`); the chunk that ends the prompt scores all but its last position, whose
logits give the first output token (its log-probs are ``logprobs``).

Ownership: the scheduler builds the rows (``raymoe.scheduler.schedule_batch``), the rank scores them
(``raymoe.runner.prompt_logprobs``) and answers in ``StepOutput.prompt_logprobs``; the scheduler appends them to the
request (``Req.add_prompt_logprobs``) and the request's first output row carries them to the front end.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptScoreRow:
    """The positions of one prefill row the ranks score.

    Attributes:
        row: the row in the step's batch (``0 <= row < bs``).
        top_k: top log-probabilities wanted per position (0: the prompt token's own only).
        num_positions: leading positions of the row's chunk scored (tokens), ``1 <= num_positions <= extend_len``.
        next_token: the token after the chunk, the target of its last position when ``num_positions`` equals
            the chunk's length; -1 when the chunk's last position is not scored (it samples).
        first_token: the prompt index of the token the row's first scored position predicts (its chunk's first
            position plus one), so the driver files the answers without looking the batch up again.
    Raises:
        ValueError: a negative row, ``top_k`` or ``first_token`` below 1, or fewer than 1 position.
    """

    row: int
    top_k: int
    num_positions: int
    next_token: int
    first_token: int

    def __post_init__(self) -> None:
        if self.row < 0 or self.top_k < 0 or self.num_positions < 1 or self.first_token < 1:
            raise ValueError(f"PromptScoreRow needs row >= 0, top_k >= 0, num_positions >= 1 and first_token >= 1, "
                             f"got {self}")

    def targets(self, chunk: list[int]) -> list[int]:
        """The token each scored position predicts, given the row's chunk of input ids (``extend_len`` tokens).

        Raises:
            ValueError: the row scores more positions than the chunk has, or its last position with no
                ``next_token``.
        """
        n = self.num_positions
        if n > len(chunk) or (n == len(chunk) and self.next_token < 0):
            raise ValueError(f"PromptScoreRow of row {self.row} scores {n} positions of a {len(chunk)}-token chunk "
                             f"with next_token {self.next_token}")
        return chunk[1:n + 1] if n < len(chunk) else chunk[1:] + [self.next_token]
