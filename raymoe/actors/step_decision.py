"""The driver's decisions for one step, made once from every DP group's :class:`~raymoe.step.step_plan.GroupPlan`
and shipped to every group as one :class:`~raymoe.step.step_plan.StepDecision`: two-batch overlap on or off
(``raymoe.overlap.decision``), then the decode-graph bucket (``raymoe.runner.graph_buckets``), then the MoE
all-to-all mode and its per-rank capacity (``raymoe.comm.a2a_plan``), and every group's token count.

The inputs are O(dp) small records; the rules are documented where they live, with the deadlock each prevents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.comm.a2a_plan import dispatch_capacity_for
from raymoe.config import OverlapConfig
from raymoe.overlap.decision import decide_tbo
from raymoe.runner.graph_buckets import plan_draft_graph_bs, plan_graph_bs
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_plan import GroupPlan, StepDecision


@dataclass(frozen=True)
class StepRules:
    """What the step's decisions depend on besides the plans (the same values the ranks were built with).

    Attributes:
        overlap: the engine's overlap options. graph_capture_sizes: the ranks' decode-graph buckets, ascending.
        a2a_mode: the engine-wide MoE all-to-all mode (``Platform.effective_a2a_mode``).
        max_dispatch_tokens_per_rank: bound of eager low-latency steps, tokens.
    """

    overlap: OverlapConfig
    graph_capture_sizes: tuple[int, ...]
    a2a_mode: str
    max_dispatch_tokens_per_rank: int


def decide_step(plans: Sequence[GroupPlan], rules: StepRules) -> StepDecision:
    """The decisions every rank of the step shares (module docstring)."""
    use_tbo = decide_tbo(plans, rules.overlap)
    # verify steps replay decode graphs as one row per token, without two-batch overlap (raymoe.runner.token_rows)
    graph_bs = plan_graph_bs(plans, rules.graph_capture_sizes, verify_rows=not use_tbo)
    capacity = dispatch_capacity_for(plans, graph_bs, rules.a2a_mode, rules.max_dispatch_tokens_per_rank)
    if use_tbo and any(p.forward_mode == ForwardMode.TARGET_VERIFY for p in plans):
        # Each rank derives its TBO children's capacity from its own mode (``child_dispatch_capacity``: half of M
        # for DECODE and IDLE rows split in halves); a verify child's token share is not bounded by half, so a
        # TBO verify step uses the normal dispatch, which every rank then agrees on.
        capacity = None
    draft_passes = any(p.draft_passes for p in plans)
    return StepDecision(global_num_tokens=tuple(p.num_tokens for p in plans), use_tbo=use_tbo, graph_bs=graph_bs,
                        dispatch_capacity=capacity, draft_passes=draft_passes,
                        draft_graph_bs=plan_draft_graph_bs(plans, rules.graph_capture_sizes) if draft_passes else None)
