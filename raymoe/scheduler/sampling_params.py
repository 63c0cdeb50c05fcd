"""Per-request sampling parameters (owned by the scheduler; copied as plain numbers into each ModelWorkerBatch).

Every field is bounded here, so a Python caller (``Engine.generate``) gets the same typed error as an HTTP client
gets a 400: :class:`~raymoe.errors.InvalidRequestError` naming the field. The HTTP front end may be stricter (its
limits are in ``raymoe.deploy.server_config.ServerLimits``) but never looser than these engine-wide caps. The
bounds include what the ranks can represent (float32 and int64 tensors, ``torch.Generator`` seeds), so a valid
``SamplingParams`` always fits a step; ``ScheduleBatch.build`` re-runs :meth:`SamplingParams.validate` on a row's
first step, so that a value changed after construction fails that request alone instead of the whole step.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

from raymoe.errors import InvalidRequestError
from raymoe.step.grammar import GrammarSpec

MAX_TOP_K = 2**31 - 1  # ranks hold top_k in an int64 tensor; anything past the vocabulary means "off" anyway
# Largest max_tokens: the scheduler caps a request at the context length anyway; this keeps tensors int32-safe.
MAX_TOKENS = 2**31 - 1
# Largest seed: the samplers seed a torch.Generator, which takes a signed 64-bit value.
MAX_SEED = 2**63 - 1
# Largest number of top log-probabilities per generated token.
MAX_LOGPROBS = 20
# Engine-wide caps on stop conditions: the driver scans a tail of each request's text for every stop string at
# every step, so their number and length are the per-step cost of a request.
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1
# Largest magnitude of temperature, top_p and min_p: the ranks hold them in float32 tensors.
FLOAT32_MAX = 3.4028234663852886e38
# OpenAI's ranges: presence and frequency penalties in [-2, 2], logit_bias values in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS_VALUE = 100.0
# Most logit_bias entries per request (each is a scatter on the ranks at every step of the request).
MAX_LOGIT_BIAS = 1 << 16
# repetition_penalty (HF transformers / vLLM / SGLang): in (0, MAX_REPETITION_PENALTY].
MAX_REPETITION_PENALTY = 1e4


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_float32(v: object) -> bool:
    """A Python int or float (not bool) that a float32 holds as a finite number."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= FLOAT32_MAX


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens.

    Attributes:
        max_tokens: maximum number of generated tokens, in [1, ``MAX_TOKENS``].
        temperature: softmax temperature, a finite int or float >= 0 that a float32 holds; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 (default) or 0 disables it; at most ``MAX_TOP_K``.
        min_p: drop tokens whose probability is below ``min_p * p_max``; in [0, 1].
        seed: per-request seed in [0, ``MAX_SEED``]; the same seed, prompt and parameters give the same tokens
            whatever the batch composition (see ``raymoe.runner.sampler``).
        stop: stop strings (at most ``MAX_STOP_STRINGS``, each 1 to ``MAX_STOP_STRING_CHARS`` characters of valid
            Unicode); generation ends when the decoded output contains one (it is cut from ``text``).
        stop_token_ids: extra token ids that end generation (besides EOS unless ``ignore_eos``); at most
            ``MAX_STOP_TOKEN_IDS``, each in [0, ``MAX_TOKEN_ID``] (the vocabulary is checked by the caller).
        ignore_eos: keep generating past EOS until ``max_tokens``.
        logprobs: number of top log-probabilities to return per generated token, in [0, ``MAX_LOGPROBS``]
            (None: none).
        prompt_logprobs: the same for each prompt token after the first (vLLM's name; the first has no
            context): the log-probability of the prompt's own token and the top ones at each position, in [0,
            ``MAX_LOGPROBS``] (None: none). The prompt is then computed in full (no radix-cache hit), since only
            a forward over a position gives its logits (``raymoe.runner.prompt_logprobs``).
        grammar: a constraint on the output (JSON object, JSON schema, regular expression, EBNF grammar;
            ``raymoe.step.grammar``), enforced on the ranks by masking the logits; None: unconstrained. A completed
            grammar ends the request (``stop``).
        presence_penalty: OpenAI's: subtracted from the logit of every token the output holds, in [-2, 2].
        frequency_penalty: OpenAI's: subtracted once per occurrence in the output, in [-2, 2].
        repetition_penalty: HF transformers' (Keskar et al. 2019, CTRL): the logit of every token seen in the prompt
            or the output is divided by it where positive, multiplied where negative; 1 is off, in (0, 1e4].
        logit_bias: token id -> value in [-100, 100] added to that token's logit at every step (OpenAI's); the ids
            are checked against the vocabulary by the caller (the engine checks them against its model). At most
            ``MAX_LOGIT_BIAS`` entries; stored as sorted ``(id, value)`` pairs.
        min_tokens: vLLM's: until the output holds this many tokens, its stop tokens (EOS unless ``ignore_eos``,
            and ``stop_token_ids``) are masked on the ranks and its stop strings are not looked for; in [0,
            ``max_tokens``]; not with a ``grammar`` (which may allow nothing but the end).
        (These apply in vLLM's order, the bias first, to the logits a request samples from, after its grammar
        mask; log-probs stay the model's. ``raymoe.runner.penalties``.)

    Raises:
        InvalidRequestError: naming the field that is out of range or of the wrong type.
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
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self._normalize_sequences()
        self.validate()

    @property
    def processes_logits(self) -> bool:
        """Whether a penalty, a logit bias or ``min_tokens`` changes this request's logits (its rows then never
        verify drafts: a penalty at a draft position would depend on the drafts before it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def validate(self) -> None:
        """Check every field against its bounds (construction does; see the module docstring for the other caller).

        Raises:
            InvalidRequestError: naming the first field that is out of range or of the wrong type.
        """
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise InvalidRequestError("max_tokens", f"must be an integer in [1, {MAX_TOKENS}], got "
                                                    f"{self.max_tokens!r}")
        if not _is_float32(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a finite number >= 0 a float32 can hold, got "
                                                     f"{self.temperature!r}")
        if not _is_float32(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError("top_k", f"must be -1, 0 or a positive integer <= {MAX_TOP_K}, "
                                               f"got {self.top_k!r}")
        if not _is_float32(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequestError("seed", f"must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequestError("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise InvalidRequestError("grammar", f"must be a GrammarSpec or None, got "
                                                     f"{type(self.grammar).__name__}")
            if (problem := self.grammar.problem()) is not None:
                raise InvalidRequestError(self.grammar.field, problem)
        self._check_stops()
        self._check_penalties()
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got "
                                                    f"{self.min_tokens!r}")
        if self.min_tokens and self.grammar is not None:
            raise InvalidRequestError("min_tokens", "cannot be combined with a grammar constraint (it may allow "
                                                    "nothing but the end)")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_float32(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise InvalidRequestError(name, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        r = self.repetition_penalty
        if not _is_float32(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError("repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY:g}], "
                                                            f"got {r!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, v in self.logit_bias:
            if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
                raise InvalidRequestError("logit_bias", f"token ids must be integers in [0, {MAX_TOKEN_ID}], got {t!r}")
            if not _is_float32(v) or not -MAX_LOGIT_BIAS_VALUE <= v <= MAX_LOGIT_BIAS_VALUE:
                raise InvalidRequestError("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                                        f"{MAX_LOGIT_BIAS_VALUE:g}], got {v!r} for token {t}")

    def _normalize_sequences(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        ids = self.stop_token_ids
        try:
            object.__setattr__(self, "stop", tuple(stop or ()))
        except TypeError:
            raise InvalidRequestError("stop", "must be a string or a sequence of strings") from None
        try:  # numpy and torch integers are fine; floats and strings are not
            object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in ids or ()))
        except TypeError:
            raise InvalidRequestError("stop_token_ids", "must be a sequence of integers") from None
        bias = self.logit_bias
        try:  # a mapping or (id, value) pairs; numpy and torch integers are fine as ids
            pairs = bias.items() if isinstance(bias, dict) else (bias or ())
            merged = {operator.index(t): v for t, v in pairs}
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias", "must map integer token ids to numbers") from None
        object.__setattr__(self, "logit_bias", tuple(sorted(merged.items())))

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                raise InvalidRequestError("stop", f"stop strings must be strings of 1 to {MAX_STOP_STRING_CHARS} "
                                                  "characters")
            if not s.isascii():
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidRequestError("stop", "stop strings must be valid Unicode (no lone surrogates)") \
                        from None
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got "
                                                        f"{len(self.stop_token_ids)}")
        if any(not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"ids must be integers in [0, {MAX_TOKEN_ID}]")
