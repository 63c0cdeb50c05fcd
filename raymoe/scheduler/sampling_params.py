"""Per-request sampling parameters (owned by the scheduler; copied as plain numbers into each ModelWorkerBatch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raymoe.errors import InvalidRequestError

MAX_TOP_K = 2**31 - 1  # ranks hold top_k in an int64 tensor; anything past the vocabulary means "off" anyway


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens.

    Attributes:
        max_tokens: maximum number of generated tokens (>= 1).
        temperature: softmax temperature (>= 0); 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (default) or 0 disables it.
        min_p: drop tokens whose probability is below ``min_p * p_max``; in [0, 1].
        seed: per-request seed; the same seed, prompt and parameters give the same tokens whatever the
            batch composition (see ``raymoe.runner.sampler``).
        stop: stop strings; generation ends when the decoded output contains one (it is cut from ``text``).
        stop_token_ids: extra token ids that end generation (besides EOS unless ``ignore_eos``).
        ignore_eos: keep generating past EOS until ``max_tokens``.
        logprobs: number of top log-probabilities to return per generated token (None: none).

    Raises:
        InvalidRequestError: naming the field that is out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature < float("inf")):
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError("top_k", f"must be -1, 0 or a positive integer <= {MAX_TOP_K}, "
                                               f"got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError("seed", f"must be a non-negative integer, got {self.seed!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise InvalidRequestError("logprobs", f"must be in [0, 20], got {self.logprobs!r}")
