"""Streamed text of one request: incremental detokenization and stop-string hold-back.

:class:`IncrementalDetokenizer` turns token ids arriving a few at a time into text without splitting multi-byte
characters: byte-level BPE tokens may end in the middle of a UTF-8 character, which a plain decode shows as
U+FFFD. It streams through the tokenizers library's ``DecodeStream`` (constant work per token).

:class:`StopStringFilter` keeps text that could still become a stop string from being shown: a streamed client
must never see part of a matched stop string. When a stop string appears, the text is cut before it.

Both are per-request and owned by ``generation.stream_pieces``; the tokenizer is the model's Hugging Face one.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Decode a growing list of token ids piece by piece.

    Built on ``tokenizers.decoders.DecodeStream`` (the tokenizers library's streaming decoder, one Rust call per
    token): it holds back the bytes of an incomplete UTF-8 character until the character is complete, so no piece
    ever ends in U+FFFD because a character was split across tokens.

    Args:
        tokenizer: a Hugging Face *fast* tokenizer (one with ``backend_tokenizer``).
        skip_special_tokens: leave special tokens (end of turn ...) out of the text.

    The concatenation of everything :meth:`push` returns equals ``tokenizer.decode(all_ids)``: ``final=True``
    flushes what the stream still holds (a trailing invalid byte sequence then shows as the decoder shows it).

    Raises:
        TypeError: the tokenizer is not a fast tokenizer.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(f"incremental detokenization needs a fast tokenizer, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._shown_chars = 0

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Add ``new_ids``; return the text they complete (may be empty while a character is incomplete)."""
        parts = []
        for t in new_ids:
            self.ids.append(int(t))
            piece = self._stream.step(self._backend, int(t))
            if piece:
                parts.append(piece)
        text = "".join(parts)
        self._shown_chars += len(text)
        if final:
            full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            rest = full[self._shown_chars:]
            self._shown_chars = len(full)
            text += rest
        return text


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
