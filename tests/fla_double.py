"""A strict CPU double of flash-linear-attention's gated delta rule kernels (``fla.ops.gated_delta_rule``, the
wrappers of ``chunk.py`` and ``fused_recurrent.py`` at fla 0.5): ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule``, batch-first ``[B, T, H, K]`` inputs, grouped value heads (``HV % H == 0``),
states ``[N, HV, K, V]`` (K-major; float32 out), varlen through ``cu_seqlens`` ([N + 1], batch 1).

What the real wrappers reject, this raises as they do (``ValueError`` / ``DeprecationWarning``): q and k with
different head counts, ``HV % H``, any ``head_first`` keyword, a ``chunk_size`` outside (16, 32, 64), ``cu_seqlens``
with a batch other than 1, or a number of initial states other than the number of sequences. Beyond them it checks
what the kernels would read wrongly without a word: ``cu_seqlens`` that does not start at 0, end at T and rise;
initial states of another shape than ``[N, HV, K, V]``; g or beta not ``[B, T, HV]``. The arithmetic is the
reference semantics (``raymoe.layers.gated_delta``; its own tests compare it with transformers) in float32; outputs
in q's dtype, final states float32, as the kernels write them.
"""

from __future__ import annotations

import torch

from raymoe.layers.gated_delta import chunk_gated_delta_rule as _chunk
from raymoe.layers.gated_delta import recurrent_gated_delta_rule as _recurrent


class Calls:
    """How many times each entry point ran (tests assert the kernel path was taken)."""

    chunk = 0
    recurrent = 0


def _common(q, k, v, g, beta, initial_state, cu_seqlens, kwargs) -> tuple[list[tuple[int, int]], int]:
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError("q, k: [B, T, H, K]; v: [B, T, HV, V]")
    b, t, h, _ = q.shape
    hv = v.shape[2]
    if hv % h:
        raise ValueError(f"For GVA, num_v_heads (HV={hv}) must be evenly divisible by num_heads (H={h})")
    if tuple(g.shape) != (b, t, hv) or tuple(beta.shape) != (b, t, hv):
        raise ValueError("g and beta must be [B, T, HV]")
    if cu_seqlens is None:
        spans = [(i, 0, t) for i in range(b)]
    else:
        if b != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {b} when using `cu_seqlens`.")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != t or any(y < x for x, y in zip(cu, cu[1:], strict=False)):
            raise ValueError(f"cu_seqlens must rise from 0 to T={t}, got {cu}")
        spans = [(0, s, e) for s, e in zip(cu, cu[1:], strict=False)]
        if initial_state is not None and initial_state.shape[0] != len(cu) - 1:
            raise ValueError("The number of initial states is expected to be equal to the number of input sequences")
    n = len(spans)
    if initial_state is not None and tuple(initial_state.shape) != (n, hv, q.shape[3], v.shape[3]):
        raise ValueError(f"initial_state must be [N={n}, HV, K, V], got {tuple(initial_state.shape)}")
    return spans, n


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size: int = 64, **kwargs):
    """(o [B, T, HV, V] in q's dtype, final [N, HV, K, V] float32 or None)."""
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if not use_qk_l2norm_in_kernel or scale not in (None, q.shape[-1] ** -0.5):
        raise NotImplementedError("the double models use_qk_l2norm_in_kernel=True with the default scale")
    spans, n = _common(q, k, v, g, beta, initial_state, cu_seqlens, kwargs)
    Calls.chunk += 1
    out = torch.empty(v.shape, dtype=q.dtype)
    finals = []
    for i, (row, s, e) in enumerate(spans):
        state = None if initial_state is None else initial_state[i].float()
        o, f = _chunk(q[row, s:e], k[row, s:e], v[row, s:e], g[row, s:e], beta[row, s:e], state, chunk_size)
        out[row, s:e] = o.to(q.dtype)
        finals.append(f)
    return out, (torch.stack(finals) if output_final_state else None)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     **kwargs):
    """One token per sequence here (decode): (o [B, 1, HV, V], final [B, HV, K, V] float32 or None)."""
    if not use_qk_l2norm_in_kernel or scale not in (None, q.shape[-1] ** -0.5):
        raise NotImplementedError("the double models use_qk_l2norm_in_kernel=True with the default scale")
    spans, n = _common(q, k, v, g, beta, initial_state, cu_seqlens, kwargs)
    if cu_seqlens is not None or q.shape[1] != 1:
        raise NotImplementedError("the double models decode: [B, 1, ...] without cu_seqlens")
    Calls.recurrent += 1
    states = initial_state.float() if initial_state is not None else torch.zeros(
        q.shape[0], v.shape[2], q.shape[3], v.shape[3])
    o, f = _recurrent(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states)
    return o.unsqueeze(1).to(q.dtype), (f if output_final_state else None)
