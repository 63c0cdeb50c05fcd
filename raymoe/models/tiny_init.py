"""Seeded tensor builders shared by the tiny-checkpoint architectures (``checkpoint``'s Qwen3-MoE and
``tiny_archs``' DeepSeek and Mixtral); imports no other raymoe module.

Weights are float32 and drawn from the caller's ``torch.Generator`` in call order, so a builder that calls these in
a fixed order is a pure function of its seed. Linear weights have std ``gain / sqrt(fan_in)``; the gains make
greedy decoding well conditioned: final logits have a std of several units and router logits are spread, so
top-1/top-k choices are not near-ties.
"""

from __future__ import annotations

import math

import torch

ROUTER_GAIN = 3.0
"""Gain of router (gate) weights."""
LM_HEAD_GAIN = 6.0
"""Gain of the LM head."""
OUT_PROJ_GAIN = 1.5
"""Gain of output projections (attention ``o_proj``, MLP ``down_proj``)."""
NORM_NOISE = 0.1
"""Std of norm weights around 1."""


def linear(gen: torch.Generator, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
    """[out_f, in_f] float32, std gain / sqrt(in_f)."""
    return torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f))


def norm(gen: torch.Generator, n: int) -> torch.Tensor:
    """[n] float32 around 1 (std ``NORM_NOISE``)."""
    return 1.0 + NORM_NOISE * torch.randn(n, generator=gen)
