"""ForwardMode: what kind of forward pass a batch runs (shared by scheduler, driver and runner)."""

from __future__ import annotations

from enum import IntEnum


class ForwardMode(IntEnum):
    """Kind of forward pass.

    EXTEND: prefill (possibly a chunk, possibly after a cached prefix) of one or more requests.
    DECODE: one new token per request.
    MIXED: extend requests and decode requests in one batch (decode rows are extends of length 1).
    IDLE: zero tokens; a DP-attention group with no work runs it so its ranks still enter every collective.
    TARGET_VERIFY: speculative decoding's verify step: each request's newest token followed by its draft tokens,
        computed like an extend after its cached prefix (causal over the drafts), with logits at every token so the
        ranks can accept the drafts the target agrees with (``raymoe.spec``).
    """

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5

    def is_extend(self) -> bool:
        """True for EXTEND, MIXED and TARGET_VERIFY (batches with per-request extend lengths)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)
