"""Speculative decoding options (SGLang's names): which drafts the target model verifies, and how many per step.

A speculative step verifies, for every decoding request with a draft, its newest token followed by up to
``speculative_num_steps`` draft tokens in one forward (``ForwardMode.TARGET_VERIFY``); the ranks accept the longest
prefix the target agrees with and add one token of their own (``raymoe.spec``).
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.config.option import check_choices, option
from raymoe.errors import InvalidRequestError

SPECULATIVE_ALGORITHMS = ("ngram", "nextn")
"""Draft methods that run: ``ngram`` (prompt lookup over the request's own prompt and output, any model) and
``nextn`` (the checkpoint's multi-token-prediction layer: DeepSeek-V3, ``num_nextn_predict_layers >= 1``)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding; each field's help says what it means.

    Raises:
        InvalidRequestError: an unknown algorithm, or a count out of range (names the field).
    """

    speculative_algorithm: str | None = option(
        None, choices=SPECULATIVE_ALGORITHMS,
        help="draft method: ngram (the tokens that followed the latest earlier occurrence of the request's last "
             "n-gram in its prompt and output: prompt lookup decoding, any model), nextn (the checkpoint's "
             "multi-token-prediction layer drafts on the ranks, a chain of speculative_num_steps tokens: DeepSeek-V3 "
             "with num_nextn_predict_layers >= 1) or None (off). Speculative steps run without overlap scheduling "
             "(the next step's positions depend on how many drafts were accepted).")
    speculative_num_steps: int = option(
        4, help="most draft tokens proposed per request and step (the verify forward computes up to this many + 1 "
                "tokens per request).")
    speculative_num_draft_tokens: int | None = option(
        None, help="tokens per request in one verify forward, the newest token included; drafts are a chain, so it "
                   "must be speculative_num_steps + 1 (None: that).")
    speculative_draft_policy: str = option(
        "adaptive", choices=("adaptive", "fixed"),
        help="adaptive: each request verifies only the drafts expected to pay for themselves, from its own "
             "acceptance and the step cost fitted online (raymoe.scheduler.spec_policy; decode stays plain where "
             "drafting does not pay, e.g. large compute-bound batches); fixed: every draft found, up to "
             "speculative_num_steps.")
    speculative_ngram_min_match_window_size: int = option(
        1, help="ngram: shortest suffix of the request's tokens looked up, tokens.")
    speculative_ngram_max_match_window_size: int = option(
        3, help="ngram: longest suffix looked up (the longest one that occurred before wins), tokens.")

    def __post_init__(self) -> None:
        check_choices(self)
        if not isinstance(self.speculative_num_steps, int) or not 1 <= self.speculative_num_steps <= 16:
            raise InvalidRequestError("speculative_num_steps", f"must be an integer in [1, 16], got "
                                                               f"{self.speculative_num_steps!r}")
        n = self.speculative_num_draft_tokens
        if n is not None and n != self.speculative_num_steps + 1:
            raise InvalidRequestError("speculative_num_draft_tokens", f"drafts are a chain: must be "
                                                                      f"speculative_num_steps + 1, got {n!r}")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not isinstance(lo, int) or not isinstance(hi, int) or not 1 <= lo <= hi <= 32:
            raise InvalidRequestError("speculative_ngram_min_match_window_size",
                                      f"need 1 <= min ({lo!r}) <= max ({hi!r}) match window <= 32")

    @property
    def enabled(self) -> bool:
        """Whether speculative steps run."""
        return self.speculative_algorithm is not None
