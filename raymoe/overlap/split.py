"""Two-batch overlap splits: where a batch is cut in two, and the two child ForwardBatches.

Split rules (DESIGN section 4; algorithms as described in the TBO reference write-up, section 5):

* DECODE: at the sequence midpoint (``bs // 2``; one token per sequence, so child B gets the extra one).
* EXTEND: at the sequence boundary that best balances the token counts; if that boundary leaves child A a token
  share outside ``[threshold, 1 - threshold]``, the *two-chunk* split cuts at token ``T // 2`` instead, splitting
  the sequence that holds that token between the children (child B's part continues after child A's, so its
  prefix grows by child A's part). If token ``T // 2`` happens to start a sequence, nothing is cut.
* IDLE: two empty children (the rank still runs both children's collectives).

The pure functions work on plain lists so that the driver's decision (``raymoe.overlap.decision``) and the rank's
split use the same code. :class:`TboForwardBatchPreparer` builds the children of a rank's ``ForwardBatch``:
token tensors are views of the parent's, each child has its own attention backend and metadata, and
``tbo_parent_token_range`` says which parent rows a child covers, so concatenating the children's outputs in
order restores the parent's token order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raymoe.comm.a2a_plan import child_dispatch_capacity
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.host_transfer import to_device


@dataclass(frozen=True)
class TboSplit:
    """Where a batch is cut.

    Attributes:
        seq_index: first sequence of child B; with ``cut`` it is the sequence both children share.
        token_index: first token of child B (child A has tokens ``[0, token_index)``).
        cut: sequence ``seq_index`` is cut across both children (two-chunk split).
        left_part: tokens of the cut sequence that child A computes (0 without a cut).
    """

    seq_index: int
    token_index: int
    cut: bool = False
    left_part: int = 0


@dataclass(frozen=True)
class ChildLens:
    """Per-sequence lengths of one child: ``seq_start``/``seq_end`` index the parent's sequences; the lists are
    the child's own prefix, extend and total lengths in tokens (a cut sequence has different values in each)."""

    seq_start: int
    seq_end: int
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]


def balanced_split_index(extend_lens: Sequence[int]) -> int:
    """Sequence boundary ``i`` in ``[1, bs)`` minimizing ``|sum(lens[:i]) - sum(lens[i:])|`` (first on ties);
    0 when ``bs < 2``."""
    total = sum(extend_lens)
    best, best_diff, left = 0, None, 0
    for i in range(1, len(extend_lens)):
        left += extend_lens[i - 1]
        diff = abs(2 * left - total)
        if best_diff is None or diff < best_diff:
            best, best_diff = i, diff
    return best


def two_chunk_split(extend_lens: Sequence[int]) -> TboSplit:
    """Cut at token ``T // 2`` (children differ by at most one token), splitting the sequence holding it."""
    token = sum(extend_lens) // 2
    start = 0
    for i, n in enumerate(extend_lens):
        if start == token:
            return TboSplit(i, token)
        if start < token < start + n:
            return TboSplit(i, token, cut=True, left_part=token - start)
        start += n
    return TboSplit(len(extend_lens), token)


def split_extend(extend_lens: Sequence[int], threshold: float) -> TboSplit:
    """Balanced sequence split, or the two-chunk split when its left share is outside ``[threshold, 1 - threshold]``."""
    total = sum(extend_lens)
    index = balanced_split_index(extend_lens)  # 0: a single sequence has no boundary to split at
    left = sum(extend_lens[:index])
    if index > 0 and threshold * total <= left <= (1 - threshold) * total:
        return TboSplit(index, left)
    return two_chunk_split(extend_lens)


def compute_split(forward_mode: ForwardMode, extend_lens: Sequence[int], threshold: float) -> TboSplit:
    """Split of a batch with per-sequence token counts ``extend_lens`` (all 1 for DECODE, empty for IDLE; a
    TARGET_VERIFY batch is split between sequences, balanced by tokens).

    Raises:
        ValueError: MIXED mode (never split).
    """
    if forward_mode == ForwardMode.DECODE:
        half = len(extend_lens) // 2
        return TboSplit(half, half)
    if forward_mode == ForwardMode.EXTEND:
        return split_extend(extend_lens, threshold)
    if forward_mode == ForwardMode.TARGET_VERIFY:  # by whole sequences (a row's drafts stay together), balanced
        index = balanced_split_index(extend_lens)
        return TboSplit(index, sum(extend_lens[:index]))
    if forward_mode == ForwardMode.IDLE:
        return TboSplit(0, 0)
    raise ValueError(f"two-batch overlap cannot split a {forward_mode.name} batch")


def split_is_usable(split: TboSplit, num_tokens: int) -> bool:
    """Both children get tokens (or the batch has none at all, like IDLE)."""
    return num_tokens == 0 or 0 < split.token_index < num_tokens


def child_lens(split: TboSplit, prefix_lens: Sequence[int], extend_lens: Sequence[int],
               seq_lens: Sequence[int]) -> tuple[ChildLens, ChildLens]:
    """Both children's sequence ranges and lengths, with the cut sequence's fields fixed up.

    Child A's part of a cut sequence ends ``left_part`` tokens into it (its ``seq_len`` shrinks); child B's part
    starts there (its prefix grows by ``left_part``, its ``seq_len`` is the parent's).
    """
    s, bs = split.seq_index, len(extend_lens)
    a_end = s + 1 if split.cut else s
    a = ChildLens(0, a_end, list(prefix_lens[:a_end]), list(extend_lens[:a_end]), list(seq_lens[:a_end]))
    b = ChildLens(s, bs, list(prefix_lens[s:]), list(extend_lens[s:]), list(seq_lens[s:]))
    if split.cut:
        a.extend_lens[-1] = split.left_part
        a.seq_lens[-1] = a.prefix_lens[-1] + split.left_part
        b.prefix_lens[0] += split.left_part
        b.extend_lens[0] -= split.left_part
    return a, b


class TboForwardBatchPreparer:
    """Builds ``forward_batch.tbo_children`` for a TBO step."""

    @classmethod
    def prepare(cls, forward_batch, threshold: float, child_backends: Sequence) -> None:
        """Split ``forward_batch`` in two children (views of its token tensors) and attach them.

        Args:
            forward_batch: the rank's ``ForwardBatch`` (DECODE, EXTEND or IDLE).
            threshold: ``tbo_token_distribution_threshold``.
            child_backends: the two attention backends the children use (each keeps its own metadata).
        Raises:
            ValueError: MIXED mode, or a batch with tokens that cannot give both children tokens.
        """
        fb = forward_batch
        split = compute_split(fb.forward_mode, fb.extend_lens_cpu, threshold)
        if not split_is_usable(split, fb.num_tokens):
            raise ValueError(f"TBO was chosen for a batch that cannot be split ({fb.num_tokens} tokens, "
                             f"{fb.batch_size} sequences)")
        lens = child_lens(split, fb.prefix_lens_cpu, fb.extend_lens_cpu, fb.seq_lens_cpu)
        ranges = [(0, split.token_index), (split.token_index, fb.num_tokens)]
        fb.tbo_children = [cls._child(fb, cl, rng, backend)
                           for cl, rng, backend in zip(lens, ranges, child_backends, strict=True)]

    @staticmethod
    def _child(parent, lens: ChildLens, token_range: tuple[int, int], backend):
        """Child over parent tokens ``token_range`` and sequences ``lens.seq_start..seq_end``: views of the
        parent's tensors (``ForwardBatch.narrow``) with the child's own lengths, sample rows and backend."""
        t0, t1 = token_range
        s0, s1 = lens.seq_start, lens.seq_end
        seq_lens = parent.seq_lens[s0:s1]
        if lens.seq_lens != parent.seq_lens_cpu[s0:s1]:  # a cut sequence: child A's part ends early
            seq_lens = to_device(lens.seq_lens, seq_lens.dtype, seq_lens.device)
        ext = to_device(lens.extend_lens, torch.int64, parent.input_ids.device)
        return parent.narrow(
            (t0, t1), (s0, s1), seq_lens=seq_lens, sample_indices=torch.cumsum(ext, 0) - 1,
            seq_lens_cpu=lens.seq_lens, prefix_lens_cpu=lens.prefix_lens, extend_lens_cpu=lens.extend_lens,
            sampling=None, attn_backend=backend, use_tbo=False, graph_bs=None, tbo_children=None,
            tbo_parent_token_range=(t0, t1),
            dispatch_capacity=child_dispatch_capacity(parent.dispatch_capacity, parent.forward_mode))
