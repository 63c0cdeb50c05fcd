"""What the speculative draft models (DeepSeek's MTP layer, ``raymoe.models.deepseek_mtp``; Qwen3.5's,
``raymoe.models.qwen3_5_mtp``; an EAGLE head, ``raymoe.models.eagle_head``) share: each mixes the next token's
embedding with a hidden state through one projection, then runs one decoder layer on the rank's attention backend.
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.errors import CheckpointError
from raymoe.overlap.operations import ForwardState


def run_decoder_layer(layer: nn.Module, x: torch.Tensor, forward_batch) -> torch.Tensor:
    """``layer``'s op list (``DecoderLayer.operations``) over ``x`` [T, H] of ``forward_batch``'s positions, without
    two-batch overlap -> its output hidden states [T, H] (its attention's KV written at the batch's slots)."""
    state = ForwardState(hidden_states=x, residual=None, forward_batch=forward_batch)
    for op in layer.operations():
        op(state)
    return state.hidden_states


def load_matrix(param: nn.Parameter, reader, name: str) -> None:
    """Copy checkpoint tensor ``name`` into ``param`` (same shape, the parameter's dtype).

    Raises:
        CheckpointError: ``name`` is missing or has another shape.
    """
    w = reader.get(name, dtype=param.dtype)
    if tuple(w.shape) != tuple(param.shape):
        raise CheckpointError(name, f"shape {tuple(w.shape)} != {tuple(param.shape)}")
    param.data.copy_(w)
