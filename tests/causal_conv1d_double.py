"""A strict CPU double of the ``causal-conv1d`` library (Dao-AILab, ``causal_conv1d`` 1.6: the Python wrappers of
``causal_conv1d_interface.py`` and the checks of ``csrc/causal_conv1d.cpp``): ``causal_conv1d_fn`` and
``causal_conv1d_update``.

What the library rejects, this raises (``RuntimeError`` where the C++ checks fail, ``NotImplementedError`` /
``AssertionError`` where the Python wrapper does): an activation other than None / "silu" / "swish"; input or weight
dtypes other than float32 / float16 / bfloat16; ``x`` not [B, C, L] or ``weight`` not [C, W]; a width outside 2-4;
neither the sequence nor the channel stride 1; the channel-last layout (``x.stride(1) == 1`` and ``x.stride(2) > 1``)
with ``C % 8`` or strides not multiples of 8; ``initial_states`` / ``final_states`` outside the channel-last layout,
of another dtype than the input, another shape than [B, C, W-1] or without channel stride 1; ``return_final_states``
without ``x.stride(1) == 1``; a bias of another dtype than the weight; for the update: a state dtype other than the
input's, a state shorter than W-1, ``conv_state_indices`` not int32, not contiguous or not [B], and a state batch
other than B without indices. The arithmetic is the library's reference (``causal_conv1d_ref`` /
``causal_conv1d_update_ref``: the conv in the weight's dtype, SiLU, output in the input's dtype); the update writes
the states in place through the indices, as the kernel does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class Calls:
    """How many times each entry point ran (tests assert the kernel path was taken)."""

    fn = 0
    update = 0


def _torch_check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


def _check_common(x: torch.Tensor, weight: torch.Tensor, bias, activation) -> tuple[int, int, int, int]:
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError("activation must be None, silu, or swish")
    _torch_check(x.dtype in _FLOATS and weight.dtype in _FLOATS, "input and weight must be float, half or bfloat16")
    _torch_check(x.dim() == 3 and weight.dim() == 2, "x must have shape (batch_size, dim, seqlen)")
    b, c, n = x.shape
    w = weight.shape[-1]
    _torch_check(tuple(weight.shape) == (c, w), "weight must have shape (dim, width)")
    _torch_check(2 <= w <= 4, "causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        _torch_check(bias.dtype == weight.dtype and tuple(bias.shape) == (c,), "bias must have shape (dim) and the "
                     "weight's dtype")
    return b, c, n, w


def _check_states(t: torch.Tensor, x: torch.Tensor, b: int, c: int, w: int, what: str) -> None:
    _torch_check(t.dtype == x.dtype, f"{what} must have the input's dtype")
    _torch_check(tuple(t.shape) == (b, c, w - 1), f"{what} must have shape (batch_size, dim, width - 1)")
    _torch_check(t.stride(1) == 1, f"{what} must have channel stride 1")


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """out [B, C, L] (and final states [B, C, W-1] with ``return_final_states``)."""
    b, c, n, w = _check_common(x, weight, bias, activation)
    _torch_check(x.stride(2) == 1 or x.stride(1) == 1, "x must have sequence or channel stride 1")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        _torch_check(c % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        _torch_check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "causal_conv1d with channel last layout "
                     "requires strides (x.stride(0) and x.stride(2)) to be multiples of 8")
    if seq_idx is not None:
        assert initial_states is None, "initial_states must be None if seq_idx is not None"
        assert not return_final_states, "If seq_idx is not None, we don't return final_states_out"
        _torch_check(channel_last, "seq_idx is only supported for channel last layout")
        raise NotImplementedError("the double does not model seq_idx")
    if initial_states is not None:
        _torch_check(channel_last, "initial_states is only supported for channel last layout")
        _check_states(initial_states, x, b, c, w, "initial_states")
    if return_final_states:
        assert x.stride(1) == 1, "Only channel-last layout support returning final_states_out"
        if final_states_out is not None:
            _check_states(final_states_out, x, b, c, w, "final_states")
    Calls.fn += 1
    xw = x.to(weight.dtype)
    full = xw if initial_states is None else torch.cat([initial_states.to(weight.dtype), xw], dim=-1)
    pad = w - 1 if initial_states is None else 0
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=pad, groups=c)[..., :n]
    out = (out if activation is None else F.silu(out)).to(x.dtype)
    out = out.transpose(1, 2).contiguous().transpose(1, 2) if channel_last else out.contiguous()
    if not return_final_states:
        return out
    src = x if initial_states is None else torch.cat([initial_states, x], dim=-1)
    final = F.pad(src, (w - 1 - src.shape[-1], 0)) if src.shape[-1] < w - 1 else src[..., -(w - 1):]
    if final_states_out is None:
        final_states_out = torch.empty(b, w - 1, c, dtype=x.dtype).transpose(1, 2)
    final_states_out.copy_(final)
    return out, final_states_out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """out [B, C] or [B, C, L]; ``conv_state`` updated in place (through ``conv_state_indices`` when given)."""
    unsqueeze = x.dim() == 2
    xx = x.unsqueeze(-1) if unsqueeze else x
    b, c, n, w = _check_common(xx, weight, bias, activation)
    _torch_check(conv_state.dtype == xx.dtype, "conv_state must have the input's dtype")
    _torch_check(conv_state.dim() == 3 and conv_state.shape[2] >= w - 1, "conv_state_len must be >= width - 1")
    if cache_seqlens is not None:
        raise NotImplementedError("the double does not model cache_seqlens")
    if conv_state_indices is not None:
        _torch_check(conv_state_indices.dtype == torch.int32, "conv_state_indices must be int32")
        _torch_check(conv_state_indices.dim() == 1 and conv_state_indices.stride(0) == 1,
                     "conv_state_indices must have stride 1")
        _torch_check(tuple(conv_state_indices.shape) == (b,), "conv_state_indices must have shape (batch_size)")
        _torch_check(tuple(conv_state.shape[1:]) == (c, conv_state.shape[2]), "conv_state must have shape "
                     "(conv_state_entries, dim, conv_state_len)")
        idx = conv_state_indices.long()
        _torch_check(bool(((idx >= 0) & (idx < conv_state.shape[0])).all()), "conv_state_indices out of range")
    else:
        _torch_check(tuple(conv_state.shape[:2]) == (b, c), "conv_state must have shape (batch_size, dim, "
                     "conv_state_len)")
        idx = torch.arange(b)
    Calls.update += 1
    states = conv_state.index_select(0, idx)
    full = torch.cat([states, xx], dim=-1).to(weight.dtype)
    conv_state.index_copy_(0, idx, full[..., -conv_state.shape[2]:].to(conv_state.dtype))
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=c)[..., -n:]
    out = (out if activation is None else F.silu(out)).to(xx.dtype)
    return out.squeeze(-1) if unsqueeze else out
