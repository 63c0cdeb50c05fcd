"""Streamed text of one request: incremental detokenization and stop-string hold-back.

:class:`IncrementalDetokenizer` turns token ids arriving a few at a time into text without splitting multi-byte
characters: byte-level BPE tokens may end in the middle of a UTF-8 character, which the tokenizer decodes as
U+FFFD. It decodes a short window (the tokens already shown plus the new ones) instead of the whole output, and
shows new text only once the window no longer ends in an incomplete character (or cannot complete it any more).

:class:`StopStringFilter` keeps text that could still become a stop string from being shown: a streamed client
must never see part of a matched stop string. When a stop string appears, the text is cut before it.

Both are per-request and owned by ``generation.stream_pieces``; the tokenizer is the model's Hugging Face one.
"""

from __future__ import annotations

from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
# An incomplete UTF-8 character at the end of the text has at most 3 bytes, so it comes from at most 3 tokens.
_MAX_TAIL_TOKENS = 3


class IncrementalDetokenizer:
    """Decode a growing list of token ids piece by piece.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        skip_special_tokens: leave special tokens (end of turn ...) out of the text.

    The concatenation of everything :meth:`push` returns equals ``tokenizer.decode(all_ids)`` for byte-level
    tokenizers (up to a trailing invalid byte sequence, which :meth:`push` with ``final=True`` flushes).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._window_start = 0  # first id of the window; ids before it are shown and never decoded again
        self._shown_end = 0  # ids[:_shown_end] are shown as text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _complete_end(self) -> int:
        """End of the longest run of ids whose window text does not end in an incomplete character (the last
        few ids may be the first bytes of a character); all ids once no such tail can explain a U+FFFD."""
        pending = len(self.ids) - self._shown_end
        for k in range(min(_MAX_TAIL_TOKENS, pending - 1) + 1):
            end = len(self.ids) - k
            if not self._decode(self.ids[self._window_start:end]).endswith(_INCOMPLETE):
                return end
        return len(self.ids) if pending > _MAX_TAIL_TOKENS else self._shown_end

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add ``new_ids``; return the text they complete (may be empty while a character is incomplete)."""
        self.ids.extend(int(t) for t in new_ids)
        end = len(self.ids) if final else self._complete_end()
        if end <= self._shown_end:
            return ""
        shown = self._decode(self.ids[self._window_start:self._shown_end])
        full = self._decode(self.ids[self._window_start:end])
        # The shown ids decode to a prefix of the window's text (same leading bytes, and the window starts
        # after a complete character).
        self._window_start, self._shown_end = self._shown_end, end
        return full[len(shown):]


class StopStringFilter:
    """Hold back text that may be the start of a stop string; cut the text at a matched stop string.

    Args:
        stop: the request's stop strings (may be empty).
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(s for s in stop if s)
        self._pending = ""
        self.matched: str | None = None

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, text: str, final: bool = False) -> str:
        """Add new ``text``; return what may be shown now. After a match (``matched`` is set) returns ``""``."""
        if self.matched is not None:
            return ""
        self._pending += text
        if not self.stop:
            out, self._pending = self._pending, ""
            return out
        # The stop string that completes first wins (as when text arrives one character at a time).
        hits = [(i + len(s), i, s) for s in self.stop if (i := self._pending.find(s)) >= 0]
        if hits:
            _, cut, self.matched = min(hits)
            out, self._pending = self._pending[:cut], ""
            return out
        keep = 0 if final else self._held_suffix_len(self._pending)
        out = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        return out
