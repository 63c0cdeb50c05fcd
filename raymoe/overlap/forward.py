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

from raymoe.overlap.fusion import Fusion
from raymoe.overlap.operations import ForwardState, execute_operations, execute_overlapped_operations
from raymoe.overlap.strategy import OperationsStrategy
from raymoe.overlap.streams import TboStreams
from raymoe.step.forward_mode import ForwardMode


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


class LayerSchedules:
    """A model's op lists for each kind of forward, built once and reused every step.

    Args:
        layers: decoder layers exposing ``operations()`` (and ``is_moe``).
        fusions: the rank's platform's fusions (``Platform.fusions()``), applied to plain forwards only: the
            overlap schedules split the runs they would fuse.
    """

    def __init__(self, layers: Sequence, fusions: Sequence[Fusion] = ()):
        self.layers = list(layers)
        self.plain = OperationsStrategy.plain(self.layers, fusions)
        self._sbo: OperationsStrategy | None = None
        self._tbo: dict[tuple[ForwardMode, str], OperationsStrategy] = {}

    def sbo(self) -> OperationsStrategy:
        """Single-batch overlap of every MoE layer (``raymoe.overlap.sbo``)."""
        if self._sbo is None:
            self._sbo = OperationsStrategy.sbo(self.layers)
        return self._sbo

    def tbo(self, forward_mode: ForwardMode, decode_schedule: str) -> OperationsStrategy:
        """The two-batch-overlap schedule of a rank whose batch has ``forward_mode``
        (:meth:`OperationsStrategy.tbo`)."""
        key = (forward_mode, decode_schedule)
        if key not in self._tbo:
            self._tbo[key] = OperationsStrategy.tbo(self.layers, forward_mode, decode_schedule)
        return self._tbo[key]

    def run(self, state: ForwardState, enable_sbo: bool = False, tbo_decode_schedule: str = "fine",
            streams: TboStreams | None = None) -> ForwardState:
        """Run the layers on ``state`` (hidden_states [T, H] in and out).

        Args:
            state: from the model's embedding; ``state.forward_batch.tbo_children`` selects two-batch overlap.
            enable_sbo: single-batch overlap inside MoE layers (a per-engine setting; ignored for TBO steps).
            tbo_decode_schedule: ``"fine"`` or ``"coarse"`` stage boundaries of DECODE TBO steps (per engine).
            streams: where a TBO step's children run (``raymoe.overlap.streams``; None: the current stream).
        Returns:
            ``state`` with the last layer's hidden states.
        """
        fb = state.forward_batch
        if fb.tbo_children is None:
            strategy = self.sbo() if enable_sbo else self.plain
            return execute_operations(state, strategy.operations)
        strategy = self.tbo(fb.forward_mode, tbo_decode_schedule)
        children = execute_overlapped_operations(split_state(state), [strategy.operations] * 2,
                                                 [0, strategy.tbo_delta_stages], streams)
        return merge_states(state, children)
