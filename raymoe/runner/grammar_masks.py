"""A constrained request's grammar state on a rank and the token masks it yields (``raymoe.runner.grammar`` keeps
one :class:`RowMatcher` per request and drives them step by step).

A mask is xgrammar's bitmask layout: ``ceil(V / 32)`` int32 words per row, token ``t`` allowed where bit ``t % 32``
of word ``t // 32`` is set. :func:`fill_all` fills the next-token masks of many matchers at once (the grammar's
tokens ANDed with those that keep the text well-formed UTF-8, ``raymoe.runner.utf8_mask``); :func:`apply_masks`
sets the refused tokens' logits to ``-inf``.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raymoe.runner.utf8_mask import Utf8Masks


@dataclass
class RowMatcher:
    """A request's grammar state on this rank: its matcher, its UTF-8 decoding state (``raymoe.runner.utf8_mask``)
    and the bitmask of its next token (``words``: [1, W] int32, numpy, once filled; ``pending``: the background fill
    that writes it)."""

    rid: str
    matcher: Any
    utf8: Utf8Masks
    stop_words: np.ndarray | None = None  # [1, W] int32 mask of the stop tokens, for a request that ignores EOS
    words: np.ndarray | None = None
    utf8_state: int = 0
    filled: bool = False
    allows_any: bool = True
    terminated: bool = False
    pending: Future | None = field(default=None, repr=False)

    def fill(self) -> None:
        """Fill the mask of the next token (idempotent until the matcher advances; :func:`fill_all`)."""
        if not self.filled:
            fill_all([self])

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (nothing changed) when the grammar refuses it."""
        if not self.matcher.accept_token(token):
            return False
        self.advanced(token, True)
        return True

    def advanced(self, token: int, may_end: bool) -> None:
        """Record that the matcher accepted ``token`` (``may_end``: it is a stop token, the only kind of token a
        matcher terminates on, so only then is the matcher asked)."""
        self.utf8_state = self.utf8.after(self.utf8_state, token)
        self.filled = False
        if may_end:
            self.terminated = self.matcher.is_terminated()

    def wait(self) -> None:
        """Wait for a background fill, then make sure the mask is filled."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        self.fill()


def xgrammar():
    import xgrammar

    return xgrammar


LITTLE_ENDIAN = sys.byteorder == "little"  # a mask's int32 words read as bytes in bit order (apply_bitmask_host)


def apply_bitmask_host(logits: torch.Tensor, words: np.ndarray, rows: list[int], vocab_size: int) -> None:
    """Set the refused tokens' logits of ``rows`` to ``-inf`` in place, on the host: what
    ``xgrammar.apply_token_bitmask_inplace`` does, in two vectorized passes (unpack the bits with numpy, one torch
    ``masked_fill_``) instead of its CPU kernel's per-element loop. ``benchmarks/grammar_mask.py --batch 16`` on
    the CI machine (one step's JSON-schema masks, float32 logits): 0.05 ms there against 0.02 ms here for the demo's
    2k vocabulary, 2.02 against 0.39 ms for a 32k one.

    Args:
        logits: [bs, V] float32 contiguous CPU tensor. words: [len(rows), ceil(vocab_size / 32)] int32 masks in
            xgrammar's layout (token ``t`` allowed where bit ``t % 32`` of word ``t // 32`` is set), row ``i`` for
            batch row ``rows[i]`` (ascending). vocab_size: tokens masked, ``<= V``; logits past it are left as they
            are (xgrammar's ``vocab_size`` meaning). Needs a little-endian host (the words are read as bytes).
    """
    refused = torch.from_numpy(np.unpackbits(np.invert(words).view(np.uint8), axis=1, count=vocab_size,
                                             bitorder="little").view(bool))
    if len(rows) == logits.shape[0] and rows[-1] == len(rows) - 1:  # rows ascend: all of them
        logits[:, :vocab_size].masked_fill_(refused, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.long)
    part = logits[index, :vocab_size]
    part.masked_fill_(refused, float("-inf"))
    logits[index, :vocab_size] = part


def apply_masks(logits: torch.Tensor, words: np.ndarray, rows: list[int], vocab_size: int) -> None:
    """Set the logits of the tokens ``words`` refuse to ``-inf`` in place, on any device.

    Args:
        logits: [N, V] float32 contiguous, on the rank's device. words: [len(rows), ceil(vocab_size / 32)] int32
            host masks, row ``i`` for logits row ``rows[i]`` (ascending). vocab_size: tokens masked (``<= V``).
    On the host :func:`apply_bitmask_host`; on an accelerator xgrammar's kernel (``apply_token_bitmask_inplace``,
    which indexes logits and masks alike, so the masks are spread over a [N, W] array of all-allowed rows).
    """
    if logits.device.type == "cpu" and LITTLE_ENDIAN:
        apply_bitmask_host(logits, words, rows, vocab_size)
        return
    full = np.full((logits.shape[0], words.shape[1]), -1, dtype=np.int32)
    full[rows] = words
    bitmask = torch.from_numpy(full)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)


def allowed(words: np.ndarray, token: int) -> bool:
    """Whether the [1, W] mask ``words`` allows ``token``."""
    return bool((int(words[0, token >> 5]) >> (token & 31)) & 1)


def xgrammar_bitmask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask over ``vocab_size`` tokens (xgrammar's layout)."""
    return (vocab_size + 31) // 32


def fill_all(matchers: list[RowMatcher]) -> None:
    """Fill the next-token masks of ``matchers`` (those not filled yet) at once: each grammar's tokens (xgrammar,
    one row of a shared [n, W] int32 array each), ANDed with the tokens that keep the text well-formed UTF-8 from
    each one's decoding state (the grammar's alone where none does), and for a request that ignores EOS without
    the stop tokens unless nothing else is allowed. The array is numpy: it may be filled on the fill thread, outside
    the rank's inference mode."""
    todo = [m for m in matchers if not m.filled]
    if not todo:
        return
    utf8 = todo[0].utf8
    words = np.empty((len(todo), utf8.words.shape[1]), dtype=np.int32)
    # one call for all rows (xgrammar's batch fill, on this thread: max_threads=1); per step, fewer numpy calls
    # matter more than their size here (a few us each on a busy rank): the common outcomes take one call each
    xgrammar().BatchGrammarMatcher(1).batch_fill_next_token_bitmask([m.matcher for m in todo], words)
    both = words & utf8.words[[m.utf8_state for m in todo]]
    fits = both.any(axis=1)
    if fits.all():
        words = both
    else:
        words[fits] = both[fits]
    ignoring = [i for i, m in enumerate(todo) if m.stop_words is not None]
    if ignoring:
        every = len(ignoring) == len(todo)
        other = (words if every else words[ignoring]) & np.invert(todo[ignoring[0]].stop_words)
        keep = other.any(axis=1)
        if every and keep.all():
            words = other
        else:
            words[np.asarray(ignoring)[keep]] = other[keep]
    allows = [True] * len(todo) if fits.all() else words.any(axis=1).tolist()
    for i, m in enumerate(todo):
        m.words, m.allows_any, m.filled = words[i:i + 1], allows[i], True
