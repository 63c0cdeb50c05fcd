"""N-gram drafts (prompt lookup decoding): guess a request's next tokens from its own prompt and output.

The request's last ``n`` tokens are looked up in its earlier tokens, longest ``n`` first (from
``speculative_ngram_max_match_window_size`` down to ``..._min_...``); the tokens that followed their most recent
earlier occurrence are the draft. Code, edits, summaries and extraction repeat their input, so the drafts are often
right and cost no model at all (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``ngram`` and SGLang's ``NGRAM``
speculative methods).

Ownership: the group's speculative steps (``raymoe.scheduler.spec_steps``) ask for one draft per decoding request
and step. The search is bounded to the last ``SEARCH_WINDOW`` tokens, so a step's cost per request does not grow
with its length, and runs as a byte search (``bytes.rfind`` over the tokens packed 4 bytes each, matches kept only
at token boundaries): about 10 us per request at a full window.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

SEARCH_WINDOW = 1024
"""Tokens (the newest) a lookup searches; older ones are not looked at."""


def propose_ngram(tokens: Sequence[int], max_draft: int, min_n: int, max_n: int) -> list[int]:
    """The draft that follows the most recent earlier occurrence of ``tokens``' longest matching suffix.

    Args:
        tokens: the request's prompt followed by its output (the newest token last).
        max_draft: most tokens proposed (``>= 0``).
        min_n, max_n: suffix lengths tried, longest first, tokens (``1 <= min_n <= max_n``).
    Returns:
        up to ``max_draft`` token ids (empty when no suffix of those lengths occurred before, or the match is
        followed by nothing).
    """
    if max_draft <= 0:
        return []
    window = list(tokens[-SEARCH_WINDOW:])
    size = len(window)
    buf = array("I", window).tobytes()
    width = buf and len(buf) // size  # bytes per token
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = buf[(size - n) * width:]
        hi = (size - 1) * width  # a match starts at token i <= size - n - 1, so it ends by token size - 1
        while True:
            pos = buf.rfind(pattern, 0, hi)
            if pos < 0:
                break
            if pos % width == 0:  # at a token boundary: the latest earlier occurrence
                start = pos // width + n
                return window[start:start + max_draft]
            hi = pos + len(pattern) - 1  # a misaligned byte match: look before it
    return []
