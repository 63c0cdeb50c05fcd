"""The driver's per-step two-batch-overlap decision, one answer for every rank.

Under TBO each rank runs two half-batches through an interleaved schedule, and the order of the MoE all-to-all
collectives follows that schedule; ranks that disagree on whether TBO runs, or on its schedule, would pair
mismatched collectives and hang. So the driver decides once per step from every DP group's batch
(:func:`decide_tbo`) and ships the answer as ``ModelWorkerBatch.use_tbo`` (:func:`apply_tbo_decision`).

TBO runs when all of these hold:

* ``OverlapConfig.enable_tbo``;
* at least one group has tokens (an all-IDLE step runs plainly) and no group runs MIXED;
* the non-IDLE groups share one schedule, and an EXTEND step has no IDLE group: a rank picks its schedule from
  its own mode (``raymoe.overlap.strategy.tbo_schedule_mode``: IDLE and TARGET_VERIFY ranks follow the DECODE
  schedule, so DECODE and speculative verify groups may share a step), so DECODE and EXTEND schedules, whose
  collective orders differ, never meet in one step;
* the busiest group has at least ``tbo_min_tokens_decode`` / ``tbo_min_tokens_extend`` tokens;
* every group with tokens can give both children tokens (same split code as the ranks, same threshold).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raymoe.config import OverlapConfig
from raymoe.overlap.split import compute_split, split_is_usable
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_plan import GroupPlan
from raymoe.step.worker_batch import ModelWorkerBatch

_SPLITTABLE = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)


def plan_of(batch: ModelWorkerBatch | None, tbo_threshold: float, draft_passes: bool = False) -> GroupPlan:
    """A group's batch as the step's decisions need it (``None``: the group has no work), its TBO split checked
    with the engine's ``tbo_token_distribution_threshold``; ``draft_passes``: the group wants the ranks' draft
    model to run after the step."""
    if batch is None or batch.forward_mode == ForwardMode.IDLE:
        return GroupPlan(ForwardMode.IDLE, 0, 0, draft_passes=draft_passes)
    splittable = batch.forward_mode in _SPLITTABLE and split_is_usable(
        compute_split(batch.forward_mode, batch.extend_lens, tbo_threshold), batch.num_tokens)
    return GroupPlan(batch.forward_mode, batch.num_tokens, batch.batch_size, splittable, draft_passes)


def decide_tbo(batches: Sequence[GroupPlan | ModelWorkerBatch], cfg: OverlapConfig) -> bool:
    """Whether this step runs two-batch overlap on every rank (see the module docstring for the rules).

    Args:
        batches: one ``GroupPlan`` per DP group (or the ``ModelWorkerBatch`` itself, IDLE batches included).
        cfg: the engine's overlap options (the same values the ranks were built with).
    """
    if not cfg.enable_tbo:
        return False
    plans = [b if isinstance(b, GroupPlan) else plan_of(b, cfg.tbo_token_distribution_threshold) for b in batches]
    active = [b for b in plans if b.forward_mode != ForwardMode.IDLE]
    if not active:
        return False
    modes = {b.forward_mode for b in active}
    if modes <= {ForwardMode.DECODE, ForwardMode.TARGET_VERIFY}:  # both follow the decode schedule
        modes = {ForwardMode.DECODE}
    if len(modes) != 1:
        return False
    mode = modes.pop()
    if mode == ForwardMode.DECODE:
        min_tokens = cfg.tbo_min_tokens_decode
    elif mode == ForwardMode.EXTEND and len(active) == len(plans):
        min_tokens = cfg.tbo_min_tokens_extend
    else:  # MIXED, or EXTEND next to IDLE groups
        return False
    if max(b.num_tokens for b in active) < min_tokens:
        return False
    return all(b.tbo_splittable for b in active)


def apply_tbo_decision(batches: Sequence[ModelWorkerBatch], cfg: OverlapConfig) -> list[ModelWorkerBatch]:
    """``batches`` with ``use_tbo`` set to :func:`decide_tbo` on every one of them (IDLE batches included)."""
    use_tbo = decide_tbo(batches, cfg)
    return [b if b.use_tbo == use_tbo else dataclasses.replace(b, use_tbo=use_tbo) for b in batches]
