"""Run a model's decoder layers: plainly, with single-batch overlap, or with two-batch overlap.

Called by the model's ``forward`` after the embedding. A ``ForwardBatch`` with ``tbo_children`` (set by the
runner's ``prepare`` for a TBO step) runs two-batch overlap: the state's hidden rows are split along the
children's ``tbo_parent_token_range`` s, both children run the layers' TBO schedule
(:class:`~raymoe.overlap.strategy.OperationsStrategy`), and the outputs are concatenated in child order, which
is the parent's token order, so the parent's ``sample_indices`` index the merged hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raymoe.overlap.operations import ForwardState, execute_operations, execute_overlapped_operations
from raymoe.overlap.strategy import OperationsStrategy


def split_state(state: ForwardState) -> list[ForwardState]:
    """One state per TBO child: views of ``state.hidden_states`` [T, H] rows (and ``residual`` when set)."""
    out = []
    for child in state.forward_batch.tbo_children:
        t0, t1 = child.tbo_parent_token_range
        residual = None if state.residual is None else state.residual[t0:t1]
        out.append(ForwardState(hidden_states=state.hidden_states[t0:t1], residual=residual, forward_batch=child))
    return out


def merge_states(parent: ForwardState, children: Sequence[ForwardState]) -> ForwardState:
    """Concatenate the children's ``hidden_states`` (and ``residual``) back into ``parent`` in child order.

    Raises:
        ValueError: the children do not cover the parent's rows contiguously and in order.
    """
    start = 0
    for c in children:
        t0, t1 = c.forward_batch.tbo_parent_token_range
        if t0 != start or c.hidden_states.shape[0] != t1 - t0:
            raise ValueError("TBO children must cover the parent's tokens contiguously, in order")
        start = t1
    if start != parent.forward_batch.num_tokens:
        raise ValueError("TBO children must cover every token of the parent")
    parent.hidden_states = torch.cat([c.hidden_states for c in children])
    residuals = [c.residual for c in children]
    parent.residual = None if all(r is None for r in residuals) else torch.cat(residuals)
    return parent


def forward_layers(layers: Sequence, state: ForwardState, enable_sbo: bool = False,
                   tbo_decode_schedule: str = "fine") -> ForwardState:
    """Run ``layers`` on ``state`` (hidden_states [T, H] in and out).

    Args:
        layers: decoder layers exposing ``operations()`` (and ``is_moe``).
        state: from the model's embedding; ``state.forward_batch.tbo_children`` selects two-batch overlap.
        enable_sbo: single-batch overlap inside MoE layers (a per-engine setting; ignored for TBO steps).
        tbo_decode_schedule: ``"fine"`` or ``"coarse"`` stage boundaries of DECODE TBO steps (per engine;
            ``OperationsStrategy.tbo``).
    Returns:
        ``state`` with the last layer's hidden states.
    """
    fb = state.forward_batch
    if fb.tbo_children is None:
        strategy = OperationsStrategy.sbo(layers) if enable_sbo else OperationsStrategy.plain(layers)
        return execute_operations(state, strategy.operations)
    strategy = OperationsStrategy.tbo(layers, fb.forward_mode, tbo_decode_schedule)
    children = execute_overlapped_operations(split_state(state), [strategy.operations] * 2,
                                             [0, strategy.tbo_delta_stages])
    return merge_states(state, children)
