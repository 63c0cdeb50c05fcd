"""Well-formed UTF-8 for constrained output: a token mask per UTF-8 decoding state, ANDed with the grammar's mask.

A byte-level vocabulary has tokens that are parts of a character, and xgrammar's byte automaton for a character
class accepts byte sequences that are not well-formed UTF-8 (overlong forms such as ``E0 90 82``, surrogates such as
``ED B6 BF``, a lead byte left without its continuation bytes): a JSON string may then hold bytes that decode to
U+FFFD, one replacement character per byte, so a ``maxLength`` the grammar counted in characters no longer holds on
the decoded text. This module keeps each constrained request on well-formed UTF-8 (Unicode Standard, Table 3-7):
the request's decoding state after its output so far is one of eight (between characters, or inside a 2-, 3- or
4-byte character with the range its next byte must lie in), and for each state a bitmask (xgrammar's layout: bit
``t % 32`` of int32 word ``t // 32``) allows the tokens whose bytes continue well-formed UTF-8 from it. Special
tokens (EOS) are allowed between characters only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# A state: (lowest and highest allowed next byte, continuation bytes still due after that one); state 0 is between
# characters. The lead byte decides the next state (Table 3-7's rows).
_STATES: list[tuple[int, int, int]] = [(0, 0, 0),  # 0: between characters
                                       (0x80, 0xBF, 0),  # 1: one continuation byte due
                                       (0x80, 0xBF, 1),  # 2: two due (E1-EC, EE-EF)
                                       (0xA0, 0xBF, 1),  # 3: two due after E0
                                       (0x80, 0x9F, 1),  # 4: two due after ED
                                       (0x80, 0xBF, 2),  # 5: three due (F1-F3)
                                       (0x90, 0xBF, 2),  # 6: three due after F0
                                       (0x80, 0x8F, 2)]  # 7: three due after F4
_AFTER_CONTINUATION = {0: 0, 1: 1, 2: 2}  # continuation bytes due after this one -> the generic state


def _lead(byte: int) -> int | None:
    """The state after a byte read between characters (None: not a lead byte of well-formed UTF-8)."""
    if byte <= 0x7F:
        return 0
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte == 0xE0:
        return 3
    if byte == 0xED:
        return 4
    if 0xE1 <= byte <= 0xEF:
        return 2
    if byte == 0xF0:
        return 6
    if byte == 0xF4:
        return 7
    if 0xF1 <= byte <= 0xF3:
        return 5
    return None


def advance(state: int, data: bytes) -> int | None:
    """The decoding state after ``data`` read from ``state`` (None: ``data`` breaks well-formed UTF-8)."""
    for b in data:
        if state == 0:
            nxt = _lead(b)
        else:
            lo, hi, due = _STATES[state]
            nxt = _AFTER_CONTINUATION[due] if lo <= b <= hi else None
        if nxt is None:
            return None
        state = nxt
    return state


class Utf8Masks:
    """Per-state token masks of one vocabulary.

    Attributes:
        words: [8, words] int32 numpy array, the token mask of each decoding state.

    Args:
        decoded_vocab: each token's bytes (xgrammar ``TokenizerInfo.decoded_vocab``), ``V`` entries.
        special_ids: tokens that are not text (EOS, control tokens): allowed between characters only, and they
            leave the state unchanged.
        words: int32 words per mask (``ceil(V / 32)``; xgrammar's bitmask width).
    """

    def __init__(self, decoded_vocab: Sequence[bytes], special_ids: Sequence[int], words: int):
        special = set(special_ids)
        bits = np.zeros((len(_STATES), words * 32), dtype=bool)
        self._after: list[dict[int, int]] = [dict() for _ in _STATES]  # non-ASCII tokens' end states
        for t, data in enumerate(decoded_vocab):
            if t in special or not data:
                bits[0, t] = True
                continue
            if data.isascii():  # most tokens: well-formed from between characters only, ending there
                bits[0, t] = True
                continue
            for s in range(len(_STATES)):
                end = advance(s, data)
                if end is not None:
                    bits[s, t] = True
                    self._after[s][t] = end
        packed = np.packbits(bits.reshape(len(_STATES), words, 32)[:, :, ::-1], axis=-1, bitorder="big")
        self.words = packed.view(">u4").astype(np.uint32).view(np.int32).reshape(len(_STATES), words)
        """[8, words] int32: the mask of each state (numpy, so the fill thread can AND it into a bitmask)."""

    def after(self, state: int, token: int) -> int:
        """The state after ``token`` (a token the mask of ``state`` allowed; others reset to between characters)."""
        return self._after[state].get(token, 0)
