"""The gated delta rule of hybrid models' linear-attention layers on CUDA through flash-linear-attention (``fla``,
``fla.ops.gated_delta_rule``), as vLLM runs Qwen3-Next / Qwen3.5 with the stock kernels.

* Extend rows of a step go in one varlen call: ``chunk_gated_delta_rule`` over the step's tokens as one batch row
  with ``cu_seqlens`` (the rows' token offsets), each sequence starting from its request's state gathered from the
  ``RecurrentStatePool`` (zeros for a fresh request), and the final states written back.
* Decode rows go in one ``fused_recurrent_gated_delta_rule`` call, one token per batch row, states gathered and
  written back by index (no host read: graphs capture it).

q and k are L2-normalized in the kernel (``use_qk_l2norm_in_kernel``) and the scale is fla's default ``K**-0.5``,
which is Qwen3.5's; states are ``[N, HV, K, V]`` float32 (fla's default layout, the pool's). The causal conv runs
in causal-conv1d's kernels (``raymoe.platform.cuda.causal_conv1d``). ``fla`` is imported on first use; where it is
missing the layers keep the torch path (``raymoe.layers.gated_delta``). CPU tests pass a strict double
(``tests/fla_double.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raymoe.step.host_transfer import to_device

_MISSING = object()


class FlaGatedDelta:
    """The fla kernels of the gated delta rule (module docstring).

    Args:
        module: a module with ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` (None:
            ``fla.ops.gated_delta_rule``, imported on first use).
    """

    def __init__(self, module: Any = None):
        self._module = module if module is not None else _MISSING

    def available(self) -> bool:
        """Whether the kernels can be called (fla imports here)."""
        if self._module is _MISSING:
            try:
                from fla.ops import gated_delta_rule
            except Exception:  # noqa: BLE001 - no wheel, no triton, no GPU: the torch path runs
                gated_delta_rule = None
            self._module = gated_delta_rule
        return self._module is not None

    def extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               lens: Sequence[int], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences of ``lens`` tokens one after another: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv],
        ``states`` [N, Hv, Dk, Dv] float32 (each sequence's initial state) -> (out [T, Hv, Dv] in q's dtype,
        final states [N, Hv, Dk, Dv] float32)."""
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        cu = to_device(offsets, torch.int64, q.device)
        out, final = self._module.chunk_gated_delta_rule(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), initial_state=states,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        return out[0], final

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], states [B, Hv, Dk, Dv] float32 ->
        (out [B, Hv, Dv], new states [B, Hv, Dk, Dv] float32)."""
        out, final = self._module.fused_recurrent_gated_delta_rule(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.unsqueeze(1), initial_state=states,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        return out[:, 0], final
