"""The driver's per-step all-to-all mode, one answer for every rank.

A low-latency dispatch exchanges buffers whose shapes depend on the per-rank capacity M, so every rank of a step
must use the same mode and the same M, or the collectives would not match. The driver decides once, after the
TBO decision and the graph bucket (``Driver.step``), and ships M as ``ModelWorkerBatch.dispatch_capacity``
(None: normal mode):

* the mode is ``resolve_a2a_mode(a2a_mode, decode step)``; a decode step has only DECODE, IDLE and TARGET_VERIFY
  groups (a verify step is a decode step with a few draft tokens per request: its per-rank token count is small
  and bounded, so it takes the low-latency dispatch when that count fits, as SGLang does for its verify steps);
* M is the step's graph bucket when it replays a graph (the graphs were captured with it), else the busiest DP
  group's token count;
* an eager step whose M exceeds ``max_tokens_per_rank`` (DeepEP's buffer bound) runs in normal mode.

A rank's TBO children each carry their own capacity (``child_dispatch_capacity``), also the same on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raymoe.comm.expert_input import resolve_a2a_mode
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.worker_batch import ModelWorkerBatch


def plan_dispatch_capacity(batches: Sequence[ModelWorkerBatch], a2a_mode: str, max_tokens_per_rank: int) -> int | None:
    """Per-rank low-latency capacity M of this step (tokens), or None for normal mode.

    Args:
        batches: one ``ModelWorkerBatch`` per DP group, with ``graph_bs`` already planned.
        a2a_mode: the engine's ``MoeCommConfig.a2a_mode``.
        max_tokens_per_rank: bound of eager low-latency steps (``EngineConfig.max_dispatch_tokens_per_rank``).

    Raises:
        ValueError: the groups disagree on ``graph_bs`` (``apply_graph_plan`` gives every group the same bucket;
            ranks that replay different buckets would exchange buffers of different shapes).
    """
    buckets = [b.graph_bs for b in batches]
    if len(set(buckets)) > 1:
        raise ValueError(f"the DP groups disagree on the graph bucket: {buckets}")
    return dispatch_capacity_for(batches, buckets[0] if batches else None, a2a_mode, max_tokens_per_rank)


def dispatch_capacity_for(plans: Sequence, graph_bs: int | None, a2a_mode: str, max_tokens_per_rank: int) -> int | None:
    """:func:`plan_dispatch_capacity` from each group's ``forward_mode`` and ``num_tokens`` (``GroupPlan`` s or
    batches, at least one) and the step's ``graph_bs``."""
    is_decode = all(b.forward_mode.is_decode_or_idle() or b.forward_mode.is_target_verify() for b in plans)
    if resolve_a2a_mode(a2a_mode, is_decode) != "low_latency":
        return None
    if graph_bs is not None:
        return graph_bs
    m = max(b.num_tokens for b in plans)
    return max(m, 1) if m <= max_tokens_per_rank else None


def apply_dispatch_plan(batches: Sequence[ModelWorkerBatch], a2a_mode: str,
                        max_tokens_per_rank: int) -> list[ModelWorkerBatch]:
    """``batches`` with ``dispatch_capacity`` set to :func:`plan_dispatch_capacity` on each."""
    capacity = plan_dispatch_capacity(batches, a2a_mode, max_tokens_per_rank)
    return [b if b.dispatch_capacity == capacity else dataclasses.replace(b, dispatch_capacity=capacity)
            for b in batches]


def child_dispatch_capacity(capacity: int | None, forward_mode: ForwardMode) -> int | None:
    """Capacity of each TBO child of a rank's batch. A DECODE batch (IDLE ranks follow the DECODE schedule)
    is split at ``bs // 2`` rows, so neither child holds more than ``ceil(M / 2)`` tokens; an EXTEND split can
    be uneven, so its children keep M."""
    if capacity is None:
        return None
    return (capacity + 1) // 2 if forward_mode.is_decode_or_idle() else capacity
