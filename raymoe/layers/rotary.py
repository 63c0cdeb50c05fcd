"""Rotary position embedding (Su et al. 2021, RoFormer): neox layout (rotate halves) or interleaved pairs.

The interleaved layout (DeepSeek-V2/V3 MLA) rotates adjacent channel pairs ``(x0, x1), (x2, x3) ...`` by one
frequency each and writes the result de-interleaved (all first members, then all second members). Queries and
keys get the same permutation, so their dot products equal those of the reference's interleaved output.

The inverse frequencies of scaled variants (``linear``, ``yarn``, ``llama3``, ``longrope`` ...) come from
``transformers.modeling_rope_utils`` so they match the checkpoint's reference implementation exactly;
``dynamic`` scaling (which depends on the running sequence length) is rejected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raymoe.config import ModelConfig
from raymoe.errors import CheckpointError


def _inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    rope = config.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":  # partial_rotary_factor: only the first head_dim * factor channels rotate
        dim = int(config.head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # host table, see below
        inv = 1.0 / (float(rope["rope_theta"]) ** exponents)
        return inv, 1.0
    if rope_type == "dynamic":
        raise CheckpointError("config.json", "dynamic RoPE scaling is not supported")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError("config.json", f"unknown rope_type {rope_type!r}")
    hf: dict[str, Any] = dict(config.hf_config)
    hf_cfg = AutoConfig.for_model(**hf) if "model_type" in hf else None
    if hf_cfg is None:
        raise CheckpointError("config.json", "model_type is needed for scaled RoPE")
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    return inv.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table applied to query/key heads.

    Shapes: ``positions`` [T] int64; ``q`` [T, Hq, D], ``k`` [T, Hk, D] (D = head_dim, rotated over all of D).
    The table is float32 [max_position_embeddings, R] and cast to ``q``'s dtype, as Hugging Face does; ``R =
    rotary_dim`` is ``D`` unless ``partial_rotary_factor`` rotates only the first ``R`` channels of each head
    (:meth:`rotate_partial`).
    ``interleaved``: rotate adjacent pairs (see the module docstring) instead of halves.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str | None = None,
                 interleaved: bool = False):
        """The table is computed in float32 on the host (as transformers does), then moved to ``device``
        (None: the current default device, e.g. the rank's device under ``with torch.device(...)``)."""
        super().__init__()
        if device is None:
            device = torch.empty(()).device  # honours the torch.device context the model is built under
        self.interleaved = interleaved
        inv_freq, scale = _inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.int64, device="cpu").float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype=dtype, device=device), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries ``q`` [T, Hq, D] and keys ``k`` [T, Hk, D] at their tokens' positions (``positions`` [T]
        int64); the table rows are gathered once for both."""
        cos, sin = self._rows(positions)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate every head of ``x`` [T, H, D] at its token's position (``positions`` [T] int64). Queries and keys
        that sit side by side in one [T, Hq + Hk, D] tensor can be rotated in one call."""
        return self._apply(x, *self._rows(positions))

    @property
    def rotary_dim(self) -> int:
        """Channels of a head the table rotates (R)."""
        return int(self.cos.shape[-1])

    def rotate_partial(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate the first :attr:`rotary_dim` channels of every head of ``x`` [T, H, D] and pass the rest through
        (transformers' ``partial_rotary_factor``); a new tensor."""
        r = self.rotary_dim
        if r == x.shape[-1]:
            return self.rotate(positions, x)
        return torch.cat((self.rotate(positions, x[..., :r]), x[..., r:]), dim=-1)

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of each position, [T, 1, D] (the first half of D when pairs are interleaved)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.interleaved:
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]
        return cos, sin

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return x * cos + self._rotate_half(x) * sin
