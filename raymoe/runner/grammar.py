"""Grammar-constrained rows on a rank: one xgrammar matcher per constrained request, masks applied to the logits
before the sampler, each matcher advanced by its sampled token.

A step's constrained rows arrive as ``ModelWorkerBatch.grammar_rows`` (``raymoe.step.grammar``). For each, the rank
keeps a matcher under the request's ReqToTokenPool row (tagged with its id). Per step:

1. :meth:`RankGrammars.mask` (after the forward, before the sampler): a row that carries ``output_ids`` (its first
   sampling step since an admission) gets a fresh matcher advanced over them; every row's next-token bitmask (the
   grammar's tokens that also keep the output well-formed UTF-8, ``raymoe.runner.utf8_mask``)
   (prepared in the background after the previous step, else filled now) is applied to the logits in place
   (disallowed tokens get ``-inf``; ``raymoe.runner.grammar_masks.apply_masks``), so greedy, top-k/p and seeded
   sampling all draw from the grammar's tokens.
2. :meth:`RankGrammars.accept` (after the sampler): the constrained rows' ids come to the host (the one host
   sync a constrained step adds), each matcher accepts its token, and the masks for the next step are filled. On
   a GPU rank they are filled on a background thread while the host answers and launches step N+1's forward, so
   the mask for step N+1 is ready when that forward's logits are (the overlap SGLang gets by filling between
   launching a forward and sampling); a CPU rank fills them at once (its forward is host work itself).

Speculative decoding (a TARGET_VERIFY step, or a MIXED one whose decode rows verify drafts): :meth:`RankGrammars.
mask_drafts` walks each constrained row's matcher along its draft and masks the logits at every draft position
with the grammar's mask there, so verification tests each draft token against the target's distribution under the
grammar (greedy rows: the tokens of plain constrained decoding; sampled rows: exactly the masked target
distribution); :meth:`RankGrammars.accept_verified` rolls the matchers back to the accepted drafts (xgrammar's
``rollback``) and advances them by the row's own token (SGLang's EAGLE verify does the same walk and rollback).

A row whose grammar allows no token (a dead end) is sampled unmasked and reported in ``dead``: the driver ends the
request (``finish_reason`` ``abort``) without its token. A row whose grammar completed (it accepted a stop token)
is reported in ``done``: the driver ends it with ``stop`` even when the request ignores EOS (such a request is
allowed a stop token only where its grammar allows nothing else). A spec that fails to
compile here (an ``Engine`` caller skipped validation) makes its row a dead end, never a failed step.

Rows without a grammar are never touched, and a step without constrained rows does nothing here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from raymoe.errors import InvalidRequestError
from raymoe.runner.grammar_compiler import GrammarCompiler
from raymoe.runner.grammar_masks import (
    RowMatcher,
    allowed,
    apply_masks,
    fill_all,
    xgrammar,
    xgrammar_bitmask_words,
)
from raymoe.runner.utf8_mask import Utf8Masks
from raymoe.step.grammar import GrammarRow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftGrammarStep:
    """A verify step's constrained rows, between :meth:`RankGrammars.mask_drafts` and
    :meth:`RankGrammars.accept_verified`.

    Attributes:
        step: the rows whose logits were masked, and the dead ends (as :class:`GrammarStep`).
        caps: [bs] the most drafts each row may accept (its draft length for an unconstrained row; 0 for a dead
            end).
        walks: per masked row (``step.rows`` order), the UTF-8 state after each draft token its matcher walked,
            starting with the state before the first.
    """

    step: GrammarStep
    caps: list[int]
    walks: list[list[int]]


@dataclass(frozen=True)
class GrammarStep:
    """The constrained rows of one step, between :meth:`RankGrammars.mask` and :meth:`RankGrammars.accept`.

    Attributes:
        rows: batch rows whose logits were masked (their matchers in ``matchers``, same order).
        dead: batch rows whose grammar allowed no token (sampled unmasked; the driver ends them).
    """

    rows: list[int]
    matchers: list[RowMatcher]
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
        self._by_pool_row: dict[int, RowMatcher] = {}
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

    def _matcher_for(self, g: GrammarRow, pool_row: int) -> RowMatcher | None:
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
        m = RowMatcher(g.rid, xgrammar().GrammarMatcher(compiled), self.utf8,
                     self.stop_words if g.ignore_eos else None)
        for t in g.output_ids:
            if not m.accept(t):
                log.warning("request %s: its output token %d does not fit its grammar", g.rid, t)
                return None
        self._by_pool_row[pool_row] = m
        return m

    def _ready(self, rows: Sequence[GrammarRow], pool_rows: Sequence[int]) -> GrammarStep:
        """The step's constrained rows whose matchers are ready, masks filled (``rows``), and its dead ends."""
        masked: list[int] = []
        matchers: list[RowMatcher] = []
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
        return GrammarStep(masked, matchers, dead)

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
        step = self._ready(rows, pool_rows)
        if step.rows:
            logits = _float32(logits)
            apply_masks(logits, np.concatenate([m.words for m in step.matchers]), step.rows,
                        min(logits.shape[-1], self.compiler.vocab_size))
        return logits, step

    def accept(self, step: GrammarStep, next_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """Advance each masked row's matcher by its sampled token and start filling the next step's masks.

        Args:
            step: what :meth:`mask` answered for this step. next_ids: [bs] int64 sampled ids (any device).
        Returns:
            ``(done, dead)`` batch rows: grammars that completed with this token, and rows that reached a dead end
            (this step's, and any whose sampled token the matcher refused).
        """
        if not step.rows:
            return [], list(step.dead)
        ids = next_ids.tolist()  # the host sync a constrained step adds
        return self._advance(step, [ids[row] for row in step.rows])

    def _advance(self, step: GrammarStep, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Each of ``step``'s matchers accepts its token (``tokens``, same order); the next masks start filling."""
        done: list[int] = []
        dead = list(step.dead)
        accepted = xgrammar().BatchGrammarMatcher.batch_accept_token([m.matcher for m in step.matchers], tokens)
        stops = self.compiler.stop_ids
        advancing: list[RowMatcher] = []
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
            fill_all(advancing)
        elif advancing:
            future = self._pool.submit(fill_all, advancing)
            for m in advancing:
                m.pending = future
        return done, dead

    def mask_drafts(self, rows: Sequence[GrammarRow], pool_rows: Sequence[int], logits: torch.Tensor,
                    windows: Sequence[tuple[int, list[int]]]) -> tuple[torch.Tensor, DraftGrammarStep]:
        """Mask a verify step's constrained rows at every position whose token is sampled or tested.

        Row ``i``'s window starts at position ``windows[i][0]`` of ``logits`` (its newest token) and holds its
        drafts ``windows[i][1]`` (``d_1 .. d_k``). The logits at window position ``j`` give the token after
        ``d_1 .. d_j``, so they are masked with the grammar's mask after those drafts: the matcher walks the draft
        (accepting each token, filling each mask) and stops before the first draft token the mask refuses, the
        first stop token (a completion is only ever the row's own token, as in plain decoding), or a token after
        which nothing is allowed. ``caps[i]`` says how many drafts it walked: verification may accept at most
        those (the rest were never masked and could not be accepted under the grammar anyway). The matchers stay
        where the walk left them until :meth:`accept_verified` rolls them back to the accepted drafts.

        Args:
            rows, pool_rows: as :meth:`mask`. logits: [T, V] float logits at every token of the step.
            windows: ``bs`` entries ``(first position, draft tokens)``; a row without a draft has ``[]``.
        Returns:
            the masked logits ([T, V] float32, as :meth:`mask`) and the step, for :meth:`accept_verified`.
        """
        step = self._ready(rows, pool_rows)
        caps = [len(d) for _, d in windows]
        for row in step.dead:
            caps[row] = 0
        positions: list[int] = []
        masks: list[np.ndarray] = []
        walks: list[list[int]] = []
        stops = self.compiler.stop_ids
        for row, m in zip(step.rows, step.matchers, strict=True):
            first, draft = windows[row]
            states = [m.utf8_state]  # the UTF-8 state after each walked draft token (for the rollback)
            positions.append(first)
            masks.append(m.words)
            cap = 0
            for token in draft:
                if token in stops or not allowed(m.words, token) or not m.matcher.accept_token(token):
                    break
                m.advanced(token, False)
                fill_all([m])
                states.append(m.utf8_state)
                if not m.allows_any:  # nothing may follow this token: it may not be accepted either
                    break
                cap += 1
                positions.append(first + cap)
                masks.append(m.words)
            caps[row] = cap
            walks.append(states)
        if positions:
            logits = _float32(logits)
            apply_masks(logits, np.concatenate(masks), positions, min(logits.shape[-1], self.compiler.vocab_size))
        return logits, DraftGrammarStep(step, caps, walks)

    def accept_verified(self, drafted: DraftGrammarStep, accept_lens: torch.Tensor,
                        next_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """After a verify step: roll each walked matcher back to the drafts the row accepted, then advance it by the
        row's own token, as :meth:`accept` does.

        Args:
            drafted: what :meth:`mask_drafts` answered. accept_lens: [bs] int64 accepted drafts per row (at most
                the row's cap). next_ids: [bs] int64 each row's own token.
        Returns:
            ``(done, dead)`` batch rows, as :meth:`accept` (a dead row keeps its accepted drafts: they fit).
        """
        step = drafted.step
        if not step.rows:
            return [], list(step.dead)
        accepted, ids = accept_lens.tolist(), next_ids.tolist()  # the host sync a constrained step adds
        for row, m, states in zip(step.rows, step.matchers, drafted.walks, strict=True):
            a = accepted[row]
            if a > drafted.caps[row]:
                raise ValueError(f"row {row} accepted {a} drafts where its grammar allowed {drafted.caps[row]}")
            walked = len(states) - 1
            if walked > a:  # (its mask is the walk's last; the row's own token below fills a new one)
                m.matcher.rollback(walked - a)
                m.utf8_state, m.filled = states[a], False
        return self._advance(step, [ids[row] for row in step.rows])


def _float32(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as a contiguous float32 tensor (itself when it is one)."""
    return logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.float().contiguous()
