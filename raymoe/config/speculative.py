"""Speculative decoding options (SGLang's names): which drafts the target model verifies, and how many per step.

A speculative step verifies, for every decoding request with a draft, its newest token followed by up to
``speculative_num_steps`` draft tokens in one forward (``ForwardMode.TARGET_VERIFY``); the ranks accept the longest
prefix the target agrees with and add one token of their own (``raymoe.spec``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from raymoe.config.option import check_choices, option
from raymoe.errors import InvalidRequestError

SPECULATIVE_ALGORITHMS = ("ngram", "nextn", "eagle")
"""Draft methods that run: ``ngram`` (prompt lookup over the request's own prompt and output, any model),
``nextn`` (the checkpoint's multi-token-prediction layer: DeepSeek-V3, ``num_nextn_predict_layers >= 1``) and
``eagle`` (a separate EAGLE-style draft head, ``speculative_draft_model_path``: Qwen3-MoE targets)."""


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
             "with num_nextn_predict_layers >= 1), eagle (an EAGLE-style draft head from speculative_draft_model_path "
             "drafts on the ranks the same way: Qwen3-MoE targets; `raymoe make-checkpoint --arch eagle --target DIR` "
             "trains one) or None (off). A step that verifies drafts or runs the draft model waits for the step "
             "before it (the next positions depend on how many drafts were accepted); the steps between overlap.")
    speculative_draft_model_path: str | None = option(
        None, help="eagle: the draft head's folder (EAGLE's layout: fc.weight, norm.weight, layers.0.*, "
                   "config.json; raymoe.models.eagle_head).")
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
        if self.speculative_algorithm == "eagle" and not self.speculative_draft_model_path:
            raise InvalidRequestError("speculative_draft_model_path", "eagle needs its draft head's folder")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not isinstance(lo, int) or not isinstance(hi, int) or not 1 <= lo <= hi <= 32:
            raise InvalidRequestError("speculative_ngram_min_match_window_size",
                                      f"need 1 <= min ({lo!r}) <= max ({hi!r}) match window <= 32")

    @property
    def enabled(self) -> bool:
        """Whether speculative steps run."""
        return self.speculative_algorithm is not None

    @property
    def tokens_per_request(self) -> int:
        """Most tokens one request computes in a decode-like step: ``speculative_num_steps + 1`` (its newest token
        and its drafts) with speculation, else 1 (bounds of the low-latency MoE dispatch)."""
        return self.speculative_num_steps + 1 if self.enabled else 1


HEAD_MODEL_TYPE = "eagle_head"
"""``model_type`` in an EAGLE draft head's ``config.json`` (``raymoe.models.eagle_head``)."""


def read_head_config(path: str | Path) -> dict:
    """An EAGLE draft head folder's ``config.json``.

    Raises:
        InvalidRequestError: ``speculative_draft_model_path`` has no head config, or it is not an EAGLE head.
    """
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise InvalidRequestError("speculative_draft_model_path", f"{cfg_file} does not exist: not an EAGLE draft "
                                                                  "head folder")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("model_type") != HEAD_MODEL_TYPE or "intermediate_size" not in cfg:
        raise InvalidRequestError("speculative_draft_model_path", f"{cfg_file} is not an EAGLE draft head "
                                                                  f"(model_type {cfg.get('model_type')!r})")
    return cfg
