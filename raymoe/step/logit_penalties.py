"""LogitPenalties: what a request's penalties and logit bias tell the ranks, once per admission (plain data).

Ownership: the scheduler builds one for a request whose ``SamplingParams.processes_logits`` on the first step after
each admission (``ScheduleBatch.build``, inside the request's ``SamplingRow``); the rank keeps the request's token
counts from it (``raymoe.runner.penalties``) and counts every token it samples for the request from then on. The
record carries the tokens the counts start from, so a request that was retracted, resumed after a fault or moved to
a decode instance (PD) counts its whole output, and a repetition penalty its whole prompt, whatever part of them
the radix cache or a KV transfer spared the ranks from computing.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True)
class LogitPenalties:
    """One request's logit processing (``raymoe.scheduler.sampling_params.SamplingParams`` documents the values).

    Attributes:
        presence: OpenAI ``presence_penalty``. frequency: OpenAI ``frequency_penalty``.
        repetition: HF ``repetition_penalty`` (1: off).
        bias: ``(token id, value)`` pairs, ids ascending and distinct.
        prompt_ids: the prompt's token ids where ``repetition != 1`` (the penalty counts them), else ``()``.
        output_ids: the tokens the request has generated before this admission.
        min_tokens: ``SamplingParams.min_tokens``: while a step samples one of the request's first ``min_tokens``
            output tokens, ``stop_ids`` are masked (0: never).
        stop_ids: the request's stop token ids (its ``stop_token_ids``, and the model's EOS ids unless
            ``ignore_eos``), ascending; ``()`` without ``min_tokens``.
    Raises:
        ValueError: ``bias`` ids not ascending and distinct.
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = [t for t, _ in self.bias]
        if any(a >= b for a, b in pairwise(ids)):
            raise ValueError("LogitPenalties.bias ids must be ascending and distinct")

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty reads token counts (a bias alone does not)."""
        return bool(self.presence or self.frequency or self.repetition != 1.0)
