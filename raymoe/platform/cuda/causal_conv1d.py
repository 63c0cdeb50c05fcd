"""The short causal conv of hybrid models' linear-attention layers on CUDA through the ``causal-conv1d`` library
(Dao-AILab, ``causal_conv1d.causal_conv1d_fn`` / ``causal_conv1d_update``), as SGLang and vLLM run Mamba-style
convs.

* **Extend**, one call per request (as the torch path): the request's new inputs as ``x`` [1, C, n] in the
  channel-last layout (``x.stride(1) == 1``: a transposed view of the step's [T, C] rows, no copy), its conv state
  as ``initial_states`` [1, C, K-1] (channel-last too; None for a fresh request) and ``return_final_states`` for
  the state it leaves, written back to the pool row. The library takes initial and final states only in the
  channel-last layout, and that layout only for ``C % 8 == 0``: :meth:`CausalConv1dKernels.supports`.
* **Decode**, one call per step: ``causal_conv1d_update`` over the step's rows with ``conv_state`` the pool's whole
  conv tensor [R, C, K-1] and ``conv_state_indices`` (int32) the rows' pool rows, so the kernel reads and updates
  each request's state in place: no gather or scatter, and nothing read on the host (graphs capture it; a bucket's
  padding rows point at the pool's dummy row).

Inputs go in float32, the pool's state dtype (the library requires the state dtype to equal the input's); the
weight stays in the model dtype (the kernel reads it as such and accumulates in float32). SiLU is fused
(``activation="silu"``). Widths 2-4 only (the library's limit). ``causal_conv1d`` is imported on first use; where
it is missing the layers keep the torch path (``raymoe.layers.gated_delta``). CPU tests pass a strict double
(``tests/causal_conv1d_double.py``).
"""

from __future__ import annotations

from typing import Any

import torch

_MISSING = object()


class CausalConv1dKernels:
    """The causal-conv1d kernels (module docstring).

    Args:
        module: a module with ``causal_conv1d_fn`` and ``causal_conv1d_update`` (None: ``causal_conv1d``, imported
            on first use).
    """

    def __init__(self, module: Any = None):
        self._module = module if module is not None else _MISSING

    def available(self) -> bool:
        """Whether the kernels can be called (``causal_conv1d`` imports here)."""
        if self._module is _MISSING:
            try:
                import causal_conv1d
            except Exception:  # noqa: BLE001 - no wheel, no GPU: the torch path runs
                causal_conv1d = None
            self._module = causal_conv1d
        return self._module is not None

    @staticmethod
    def supports(channels: int, width: int) -> bool:
        """Whether the library takes a conv of ``channels`` channels and kernel ``width`` with initial states
        (channel-last layout: ``channels % 8 == 0``; ``2 <= width <= 4``)."""
        return channels % 8 == 0 and 2 <= width <= 4

    def extend_row(self, x: torch.Tensor, weight: torch.Tensor,
                   conv_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's new inputs: ``x`` [n, C] (any float dtype), ``weight`` [C, K], ``conv_state`` [C, K-1]
        float32 (its previous K-1 inputs; None: a fresh request, zeros) -> (``silu(conv)`` [n, C] in x's dtype,
        the new state [C, K-1] float32: the last K-1 inputs of ``state ++ x``)."""
        n, c = x.shape
        xc = x.float().contiguous().t().unsqueeze(0)                       # [1, C, n], stride(1) == 1
        init = None
        if conv_state is not None:
            init = conv_state.t().contiguous().t().unsqueeze(0)            # [1, C, K-1], stride(1) == 1
        out, final = self._module.causal_conv1d_fn(xc, weight, None, initial_states=init, return_final_states=True,
                                                   activation="silu")
        return out[0].t().to(x.dtype), final[0]

    def decode(self, x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
        """One new input per row: ``x`` [B, C], ``weight`` [C, K], ``conv_pool`` [R, C, K-1] float32 (every pool
        row's state; rows ``rows`` [B] are read and updated in place) -> ``silu(conv)`` [B, C] in x's dtype."""
        out = self._module.causal_conv1d_update(x.float(), conv_pool, weight, None, activation="silu",
                                                conv_state_indices=rows.to(torch.int32))
        return out.to(x.dtype)
