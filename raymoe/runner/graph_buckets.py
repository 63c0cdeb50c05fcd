"""Decode graph buckets: which batch sizes and KV widths are captured, and which graph a step replays.

Pure functions over plain numbers (no torch), shared by both sides of the step boundary:

* the rank's ``GraphRunner`` captures one graph per size in :func:`capture_sizes` (``RunnerConfig`` exposes the
  result as ``RunnerConfig.graph_capture_sizes``);
* the driver calls :func:`apply_graph_plan` (:func:`plan_graph_bs` + ``replace``) once per global step with
  every DP group's ``ModelWorkerBatch``, after the TBO decision, and ships the answer in
  ``ModelWorkerBatch.graph_bs`` to all ranks, so every rank pads to the same size and the MoE collectives of
  all ranks see the same number of rows;
* on CUDA the rank also captures each bucket at every KV width of :func:`kv_width_ladder` and a replay takes
  :func:`select_kv_width` of the step's longest sequence. The width changes only the attention of the rank's own
  rows (no collective), so it is a rank-local choice made from the host copy of the sequence lengths: no driver
  decision, no host sync, and ranks of one step may replay different widths.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Sequence

from raymoe.config.graph import DEFAULT_MIN_KV_WIDTH
from raymoe.step.forward_mode import ForwardMode

SMALL_SIZES = (1, 2, 4, 8)


def default_capture_sizes(max_bs: int) -> list[int]:
    """The default bucket ladder up to ``max_bs``: 1, 2, 4, 8, then 16, 24, 32, 48, 64, 96, 128, ...
    (each power of two and the midpoint to the next), always ending with ``max_bs`` itself so that every
    batch up to ``max_bs`` has a bucket.

    Raises:
        ValueError: ``max_bs < 1``.
    """
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = list(SMALL_SIZES)
    p = 16
    while p <= max_bs:
        sizes += [p, p + p // 2]
        p *= 2
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def capture_sizes(max_running: int, cuda_graph_bs: Sequence[int] | None = None,
                  cuda_graph_max_bs: int | None = None) -> list[int]:
    """Resolve the batch sizes to capture, ascending and unique.

    Args:
        max_running: rows of the rank's ReqToTokenPool (no decode batch is larger).
        cuda_graph_bs: explicit sizes; ``None`` uses :func:`default_capture_sizes`. Explicit sizes are kept
            as given (minus those above the cap), so a batch above the largest one runs eagerly.
        cuda_graph_max_bs: cap on the largest size; ``None`` caps at ``max_running``.
    Raises:
        ValueError: a size or the cap is below 1.
    """
    cap = max_running if cuda_graph_max_bs is None else min(cuda_graph_max_bs, max_running)
    if cap < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {cuda_graph_max_bs}")
    if cuda_graph_bs is None:
        return default_capture_sizes(cap)
    if any(s < 1 for s in cuda_graph_bs):
        raise ValueError(f"cuda_graph_bs sizes must be >= 1, got {list(cuda_graph_bs)}")
    return sorted({int(s) for s in cuda_graph_bs if s <= cap})


def select_graph_bs(batch_size: int, sizes: Sequence[int]) -> int | None:
    """Smallest captured size >= ``batch_size`` (``sizes`` ascending), or ``None`` when the batch is larger
    than every captured size (or nothing was captured): run eagerly."""
    i = bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def plan_graph_bs(batches: Sequence, sizes: Sequence[int], verify_rows: bool = False) -> int | None:
    """The one bucket every rank replays this step, or ``None`` for an eager step.

    Graphs run only when every DP group is DECODE or IDLE and at least one decodes; the bucket covers the
    largest group, and IDLE groups replay it with padding rows only (so collective sizes match). With
    ``verify_rows`` a TARGET_VERIFY group counts too, as one decode row per token (``raymoe.runner.token_rows``:
    its ``num_tokens`` rows).

    Args:
        batches: one ``ModelWorkerBatch`` per DP group (anything with ``forward_mode``, ``batch_size`` and
            ``num_tokens``).
        sizes: the ranks' captured sizes, ascending (``RunnerConfig.graph_capture_sizes``).
        verify_rows: verify steps may replay decode graphs (the driver passes it for steps without two-batch
            overlap).
    """
    if not sizes or not batches:
        return None
    graphed = (ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY) if verify_rows else (
        ForwardMode.DECODE, ForwardMode.IDLE)
    if any(b.forward_mode not in graphed for b in batches):
        return None
    if all(b.forward_mode == ForwardMode.IDLE for b in batches):
        return None
    return select_graph_bs(max(b.num_tokens if b.forward_mode == ForwardMode.TARGET_VERIFY else b.batch_size
                               for b in batches), sizes)


def plan_draft_graph_bs(batches: Sequence, sizes: Sequence[int]) -> int | None:
    """The one bucket every rank replays the draft model's decode passes in (``raymoe.runner.mtp_drafter``), or
    ``None`` for eager passes.

    A draft decode pass has a row per row of the step that samples, at most the group's ``batch_size`` whatever
    its mode (a verify or MIXED step too), so the bucket covers the largest group's rows; IDLE groups replay it with
    padding rows only. ``None`` when no size holds the largest group or no group has rows.

    Args:
        batches: one plan or ``ModelWorkerBatch`` per DP group (``batch_size``). sizes: as :func:`plan_graph_bs`.
    """
    if not sizes or not batches:
        return None
    rows = max(b.batch_size for b in batches)
    return select_graph_bs(rows, sizes) if rows else None


def apply_graph_plan(batches: Sequence, sizes: Sequence[int]) -> list:
    """``batches`` (``ModelWorkerBatch`` per DP group) with ``graph_bs`` set to :func:`plan_graph_bs` on each."""
    graph_bs = plan_graph_bs(batches, sizes)
    return [b if b.graph_bs == graph_bs else dataclasses.replace(b, graph_bs=graph_bs) for b in batches]


def kv_width_ladder(max_kv_len: int, min_kv_width: int | None = DEFAULT_MIN_KV_WIDTH) -> list[int]:
    """KV widths (tokens) the decode graphs of a bucket are captured at, ascending: ``min_kv_width``, doubling
    while below ``max_kv_len``, and always ``max_kv_len`` itself (the ReqToTokenPool row width), so that every
    sequence has a width. A graph at width W attends over W key positions per row (masked past its seq_len).

    Args:
        max_kv_len: the longest sequence a graph must hold, tokens (>= 1).
        min_kv_width: first width, tokens (>= 1); ``None`` disables the ladder: ``[max_kv_len]`` only.
    Raises:
        ValueError: ``max_kv_len`` or ``min_kv_width`` below 1.
    """
    if max_kv_len < 1:
        raise ValueError(f"max_kv_len must be >= 1, got {max_kv_len}")
    if min_kv_width is None:
        return [max_kv_len]
    if min_kv_width < 1:
        raise ValueError(f"min_kv_width must be >= 1, got {min_kv_width}")
    widths, w = [], min_kv_width
    while w < max_kv_len:
        widths.append(w)
        w *= 2
    return widths + [max_kv_len]


def select_kv_width(max_seq_len: int, widths: Sequence[int]) -> int | None:
    """Smallest captured KV width >= ``max_seq_len`` (the step's longest sequence, padding rows included, tokens;
    ``widths`` ascending), or ``None`` when the sequence is longer than every width."""
    return select_graph_bs(max_seq_len, widths)
