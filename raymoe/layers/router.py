"""MoE routing: router logits -> top-k expert ids and combine weights, for every supported family.

Variants (``raymoe.config_arch.RouterConfig``):

* softmax + greedy top-k, optional renormalization: Qwen3-MoE, Mixtral (always renormalized), DeepSeek-V2 ``greedy``.
* softmax + group-limited greedy: DeepSeek-V2 ``group_limited_greedy`` (DeepSeek-V2 paper Sec. 2.2.2, device-limited
  routing): experts form ``n_group`` equal groups, a group scores its best expert, only the ``topk_group`` best
  groups stay eligible (the rest are masked with 0), then top-k.
* sigmoid + group-limited with a correction bias: DeepSeek-V3 (arXiv:2412.19437 Sec. 2.1.2, auxiliary-loss-free
  balancing): the choice uses ``sigmoid(logits) + e_score_correction_bias``, a group scores the sum of its best
  two, masked experts get -inf; the weights are the uncorrected sigmoid scores, renormalized (+1e-20).

Every variant finally multiplies the weights by ``routed_scaling_factor``. Scores are computed in float32. The softmax
greedy variant is the platform's ``topk_softmax`` operation (one fused kernel on a CPU rank).
"""

from __future__ import annotations

import torch

from raymoe.config_arch import RouterConfig
from raymoe.platform.interface import Platform


def _group_mask(choice: torch.Tensor, cfg: RouterConfig) -> torch.Tensor:
    """Bool [T, E]: experts of the ``topk_group`` best groups of each token (``choice`` [T, E] float32)."""
    t, e = choice.shape
    grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
    if cfg.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.unsqueeze(-1).expand(t, cfg.n_group, e // cfg.n_group).reshape(t, e)


def select_experts(ops: Platform, router_logits: torch.Tensor, top_k: int, cfg: RouterConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token.

    Args:
        ops: the rank's platform (the softmax greedy variant is its ``topk_softmax``).
        router_logits: [T, E] gate outputs (any float dtype; scored in float32).
        top_k: experts per token (<= E; with group-limited routing, <= eligible experts).
        cfg: the routing variant.
        correction_bias: [E] float32 ``e_score_correction_bias``; required iff ``cfg.use_correction_bias``.
    Returns:
        ``(weights, ids)``: float32 [T, top_k] combine weights and int64 [T, top_k] expert ids.
    Raises:
        ValueError: the bias is missing though the config asks for it.
    """
    if cfg.is_softmax_greedy:
        return ops.topk_softmax(router_logits, top_k, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    logits = router_logits.float()
    scores = torch.sigmoid(logits) if cfg.scoring_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores
    if cfg.use_correction_bias:
        if correction_bias is None:
            raise ValueError("this router needs e_score_correction_bias")
        choice = scores + correction_bias.float()
    if cfg.topk_method == "group_limited" and scores.shape[0]:
        choice = choice.masked_fill(~_group_mask(choice, cfg), cfg.masked_fill)
    if cfg.use_correction_bias:
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.topk(choice, k=top_k, dim=-1)
    if cfg.norm_topk_prob:
        denom = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denom + 1e-20 if cfg.use_correction_bias else denom)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids
