"""What a prompt must satisfy before the engine accepts it: the one place these rules live.

Ownership: each group's ``Scheduler`` applies :meth:`RequestLimits.check_prompt` and
:meth:`RequestLimits.check_logprobs` when it accepts a request (``raymoe.scheduler.intake``), and every way into the
engine (the offline ``Engine``, the HTTP front end through the driver actor) goes through that; the driver trusts
the result. The HTTP front end calls the same prompt check before tokens reach the engine, so that it answers 400
without a round trip (``raymoe.deploy.request_prep``), and :meth:`RequestLimits.check_output_room` on a request
that names its output length (OpenAI's rule: prompt + ``max_tokens`` must fit the context; the engine itself stops
a request at the context, ``finish_reason`` "length"). The sampling numbers themselves are checked by
``SamplingParams``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.errors import ContextLengthError, InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    """The sizes a request must fit, in tokens.

    Attributes:
        max_context_len: longest sequence (prompt + output); a prompt must leave room for one output token.
        vocab_size: token ids (and the number of top log-probabilities) must be below it; ``None``: unchecked.
        kv_pool_tokens: the prompt's KV must fit in a pool of this many slots; ``None``: unchecked.

    Raises:
        ValueError: a limit is below 1.
    """

    max_context_len: int
    vocab_size: int | None = None
    kv_pool_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_context_len", "vocab_size", "kv_pool_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"RequestLimits.{name} must be >= 1, got {v}")

    def check_prompt(self, ids: Sequence[int], field: str = "prompt") -> None:
        """Refuse a prompt (token ids) that is empty, holds an id outside the vocabulary, leaves no room for an
        output token within ``max_context_len``, or is longer than the KV pool. O(len(ids)).

        Raises:
            ContextLengthError: (an ``InvalidRequestError``) naming ``field``, when the prompt fills the context.
            InvalidRequestError: naming ``field``, for the other reasons.
        """
        n = len(ids)
        if n == 0:
            raise InvalidRequestError(field, "the prompt is empty")
        if self.vocab_size is not None and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            i = next(i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(field, f"token id {ids[i]} at position {i} is outside the vocabulary: token ids "
                                             f"must be in [0, {self.vocab_size})")
        if n >= self.max_context_len:
            raise ContextLengthError(field, f"the prompt has {n} tokens; this model's context holds "
                                            f"{self.max_context_len} tokens (prompt + output)")
        if self.kv_pool_tokens is not None and n > self.kv_pool_tokens:
            raise InvalidRequestError(field, f"the prompt has {n} tokens, more than the KV pool "
                                             f"({self.kv_pool_tokens} tokens)")

    def check_output_room(self, prompt_tokens: int, max_tokens: int, field: str = "prompt") -> None:
        """Refuse a request whose prompt plus the output it asks for (``max_tokens``) is longer than the context.

        Raises:
            ContextLengthError: naming ``field``, with both numbers (OpenAI's and vLLM's wording).
        """
        if prompt_tokens + max_tokens > self.max_context_len:
            where = "messages" if field == "messages" else "prompt"
            raise ContextLengthError(
                field, f"This model's maximum context length is {self.max_context_len} tokens. However, you "
                       f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} "
                       f"in the completion). Please reduce the length of the {where} or completion.")

    def check_logprobs(self, logprobs: int | None, field: str = "logprobs") -> None:
        """Refuse asking for more top log-probabilities per token than the vocabulary has.

        Raises:
            InvalidRequestError: ``field`` (``"logprobs"`` or ``"prompt_logprobs"``).
        """
        if self.vocab_size is not None and logprobs is not None and logprobs > self.vocab_size:
            raise InvalidRequestError(field, f"must be <= the vocabulary size {self.vocab_size}")

    def check_logit_bias(self, bias: Sequence[tuple[int, float]]) -> None:
        """Refuse a ``logit_bias`` token id outside the vocabulary (``bias``: ascending ``(id, value)`` pairs).

        Raises:
            InvalidRequestError: ``"logit_bias"``, naming the id.
        """
        if self.vocab_size is not None and bias and bias[-1][0] >= self.vocab_size:
            raise InvalidRequestError("logit_bias", f"token id {bias[-1][0]} is outside the vocabulary: token ids "
                                                    f"must be in [0, {self.vocab_size})")
