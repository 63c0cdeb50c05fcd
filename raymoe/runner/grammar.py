"""Grammar-constrained rows on a rank: one xgrammar matcher per constrained request, masks applied to the logits
before the sampler, each matcher advanced by its sampled token.

A step's constrained rows arrive as ``ModelWorkerBatch.grammar_rows`` (``raymoe.step.grammar``). For each, the rank
keeps a matcher under the request's ReqToTokenPool row (tagged with its id). Per step:

1. :meth:`RankGrammars.mask` (after the forward, before the sampler): a row that carries ``output_ids`` (its first
   sampling step since an admission) gets a fresh matcher advanced over them; every row's next-token bitmask (the
   grammar's tokens that also keep the output well-formed UTF-8, ``raymoe.runner.utf8_mask``)
   (prepared in the background after the previous step, else filled now) is copied into a ``[bs, ceil(V/32)]``
   int32 bitmask and applied to the logits in place (disallowed tokens get ``-inf``: xgrammar's
   ``apply_token_bitmask_inplace`` on an accelerator, :func:`apply_bitmask_host` on a CPU rank), so greedy, top-k/p and seeded sampling all draw from the grammar's tokens.
2. :meth:`RankGrammars.accept` (after the sampler): the constrained rows' ids come to the host (the one host
   sync a constrained step adds), each matcher accepts its token, and the masks for the next step are filled. On
   a GPU rank they are filled on a background thread while the host answers and launches step N+1's forward, so
   the mask for step N+1 is ready when that forward's logits are (the overlap SGLang gets by filling between
   launching a forward and sampling); a CPU rank fills them at once (its forward is host work itself).

A row whose grammar allows no token (a dead end) is sampled unmasked and reported in ``dead``: the driver ends the
request (``finish_reason`` ``abort``) without its token. A row whose grammar completed (it accepted a stop token)
is reported in ``done``: the driver ends it with ``stop`` even when the request ignores EOS (such a request is
allowed a stop token only where its grammar allows nothing else). A spec that fails to
compile here (an ``Engine`` caller skipped validation) makes its row a dead end, never a failed step.

Rows without a grammar are never touched, and a step without constrained rows does nothing here.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raymoe.errors import InvalidRequestError
from raymoe.runner.grammar_compiler import GrammarCompiler
from raymoe.runner.utf8_mask import Utf8Masks
from raymoe.step.grammar import GrammarRow

log = logging.getLogger(__name__)


@dataclass
class _Matcher:
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
        """Fill the mask of the next token (idempotent until the matcher advances; :func:`_fill_all`)."""
        if not self.filled:
            _fill_all([self])

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


@dataclass(frozen=True)
class GrammarStep:
    """The constrained rows of one step, between :meth:`RankGrammars.mask` and :meth:`RankGrammars.accept`.

    Attributes:
        rows: batch rows whose logits were masked (their matchers in ``matchers``, same order).
        dead: batch rows whose grammar allowed no token (sampled unmasked; the driver ends them).
    """

    rows: list[int]
    matchers: list[_Matcher]
    dead: list[int]


class RankGrammars:
    """The rank's matchers (module docstring).

    Args:
        compiler: builds the :class:`GrammarCompiler` for the rank's model on first use (loading the tokenizer).
        device: the logits' device.
        fill_in_background: fill the next step's masks on a thread (None: on GPU ranks, whose host goes on to
            launch the next step while it fills; a CPU rank's forward is its own host work, so there a thread only
            adds GIL and core contention: measured no faster on the CI machine, and it fills right after sampling).
    """

    def __init__(self, compiler: Callable[[], GrammarCompiler], device: torch.device,
                 fill_in_background: bool | None = None):
        self._make_compiler = compiler
        self._compiler: GrammarCompiler | None = None
        self._utf8: Utf8Masks | None = None
        self._stop_words: np.ndarray | None = None
        self.device = device
        self._by_pool_row: dict[int, _Matcher] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.fill_in_background = device.type != "cpu" if fill_in_background is None else fill_in_background

    @property
    def compiler(self) -> GrammarCompiler:
        """The model's compiler (built on the first constrained row)."""
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler

    @property
    def stop_words(self) -> np.ndarray:
        """[1, W] int32: the bits of the model's stop tokens (xgrammar's bitmask layout)."""
        if self._stop_words is None:
            info = self.compiler.info
            words = np.zeros((1, xgrammar_bitmask_words(info.vocab_size)), dtype=np.uint32)
            for t in info.stop_token_ids:
                words[0, t // 32] |= np.uint32(1 << (t % 32))
            self._stop_words = words.view(np.int32)
        return self._stop_words

    @property
    def utf8(self) -> Utf8Masks:
        """The vocabulary's UTF-8 state masks (built on the first constrained row)."""
        if self._utf8 is None:
            info = self.compiler.info
            self._utf8 = Utf8Masks(info.decoded_vocab, info.special_token_ids, xgrammar_bitmask_words(info.vocab_size))
        return self._utf8

    def _matcher_for(self, g: GrammarRow, pool_row: int) -> _Matcher | None:
        """The row's matcher: rebuilt and advanced over ``g.output_ids`` when sent, else the one kept for this
        request (None: it cannot be built, or a token it was given does not fit its grammar)."""
        m = self._by_pool_row.get(pool_row)
        if g.output_ids is None and m is not None and m.rid == g.rid:
            return m
        if g.output_ids is None:
            log.error("grammar row %d of request %s arrived without its tokens and no matcher is kept", g.row, g.rid)
            return None
        self._by_pool_row.pop(pool_row, None)
        try:
            compiled = self.compiler.compile(g.spec)
        except InvalidRequestError as e:
            log.warning("request %s: %s", g.rid, e)
            return None
        m = _Matcher(g.rid, _xgrammar().GrammarMatcher(compiled), self.utf8,
                     self.stop_words if g.ignore_eos else None)
        for t in g.output_ids:
            if not m.accept(t):
                log.warning("request %s: its output token %d does not fit its grammar", g.rid, t)
                return None
        self._by_pool_row[pool_row] = m
        return m

    def mask(self, rows: Sequence[GrammarRow], pool_rows: Sequence[int],
             logits: torch.Tensor) -> tuple[torch.Tensor, GrammarStep]:
        """Mask the constrained rows of ``logits``.

        Args:
            rows: the step's constrained rows. pool_rows: [bs] the batch's ReqToTokenPool rows (host list).
            logits: [bs, V] float logits on the rank's device.
        Returns:
            the masked logits ([bs, V] float32: ``logits`` itself, masked in place, when it is a contiguous float32
            tensor, else a masked copy) and the step's constrained rows, for :meth:`accept`.
        """
        masked: list[int] = []
        matchers: list[_Matcher] = []
        dead: list[int] = []
        kept = self._by_pool_row
        for g in rows:
            m = kept.get(pool_rows[g.row])
            if g.output_ids is None and m is not None and m.rid == g.rid and m.filled and m.allows_any \
                    and not m.terminated:  # the common case: a kept matcher, its mask filled
                masked.append(g.row)
                matchers.append(m)
                continue
            m = self._matcher_for(g, pool_rows[g.row])
            if m is None or m.terminated:
                if m is None:
                    dead.append(g.row)
                continue  # a completed grammar's row is in flight after its request ended: the driver skips it
            m.wait()
            if not m.allows_any:
                dead.append(g.row)
                continue
            masked.append(g.row)
            matchers.append(m)
        if masked:
            if logits.dtype != torch.float32 or not logits.is_contiguous():
                logits = logits.float().contiguous()
            vocab = min(logits.shape[-1], self.compiler.vocab_size)
            if self.device.type == "cpu" and _LITTLE_ENDIAN:
                apply_bitmask_host(logits, np.concatenate([m.words for m in matchers]), masked, vocab)
            else:
                words = np.full((logits.shape[0], matchers[0].words.shape[1]), -1, dtype=np.int32)
                words[masked] = np.concatenate([m.words for m in matchers])  # xgrammar indexes logits, masks alike
                bitmask = torch.from_numpy(words)
                bitmask = bitmask.to(self.device, non_blocking=True) if self.device.type != "cpu" else bitmask
                _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=masked)
        return logits, GrammarStep(masked, matchers, dead)

    def accept(self, step: GrammarStep, next_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """Advance each masked row's matcher by its sampled token and start filling the next step's masks.

        Args:
            step: what :meth:`mask` answered for this step. next_ids: [bs] int64 sampled ids (any device).
        Returns:
            ``(done, dead)`` batch rows: grammars that completed with this token, and rows that reached a dead end
            (this step's, and any whose sampled token the matcher refused).
        """
        done: list[int] = []
        dead = list(step.dead)
        if not step.rows:
            return done, dead
        ids = next_ids.tolist()  # the host sync a constrained step adds
        tokens = [ids[row] for row in step.rows]
        accepted = _xgrammar().BatchGrammarMatcher.batch_accept_token([m.matcher for m in step.matchers], tokens)
        stops = self.compiler.stop_ids
        advancing: list[_Matcher] = []
        for row, m, token, ok in zip(step.rows, step.matchers, tokens, accepted, strict=True):
            if not ok:
                dead.append(row)
                continue
            m.advanced(token, token in stops)
            if m.terminated:
                done.append(row)
            else:
                advancing.append(m)
        if advancing and not self.fill_in_background:
            _fill_all(advancing)
        elif advancing:
            future = self._pool.submit(_fill_all, advancing)
            for m in advancing:
                m.pending = future
        return done, dead


def _xgrammar():
    import xgrammar

    return xgrammar


_LITTLE_ENDIAN = sys.byteorder == "little"  # a mask's int32 words read as bytes in bit order (apply_bitmask_host)


def apply_bitmask_host(logits: torch.Tensor, words: np.ndarray, rows: list[int], vocab_size: int) -> None:
    """Set the refused tokens' logits of ``rows`` to ``-inf`` in place, on the host: what
    ``xgrammar.apply_token_bitmask_inplace`` does, in two vectorized passes (unpack the bits with numpy, one torch
    ``masked_fill_``) instead of its CPU kernel's per-element loop, which took 124 us for 16 rows of a 2k vocabulary
    and 9.0 ms for 16 rows of 152k on the CI machine against 23 us and 1.0 ms this way (``benchmarks/
    grammar_mask.py``).

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


def xgrammar_bitmask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask over ``vocab_size`` tokens (xgrammar's layout)."""
    return (vocab_size + 31) // 32


def _fill_all(matchers: list[_Matcher]) -> None:
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
    _xgrammar().BatchGrammarMatcher(1).batch_fill_next_token_bitmask([m.matcher for m in todo], words)
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
