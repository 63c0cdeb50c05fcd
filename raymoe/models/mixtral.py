"""Mixtral (Jiang et al. 2024, arXiv:2401.04088) on raymoe's parallel layers.

Architecture: embedding -> N pre-norm decoder layers (GQA attention with neox RoPE, no q/k norms; a sparse MoE
block in every layer: softmax router, top-k renormalized, SwiGLU experts) -> RMSNorm -> LM head. The layers reuse
Qwen3-MoE's attention (``qk_norm=False``) and the shared decoder skeleton (``raymoe.models.decoder``).

Checkpoint names: ``model.layers.i.block_sparse_moe.gate.weight`` and per-expert
``block_sparse_moe.experts.E.{w1, w3, w2}.weight`` (gate, up, down), read through :class:`MixtralNames`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.eplb.location import ExpertLocation
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, MoeCausalLM, build_mlp
from raymoe.models.qwen3_moe import Qwen3MoeAttention
from raymoe.models.reader_views import RenamedReader
from raymoe.platform.interface import Platform

_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv|weight_scale)$")
_MIXTRAL_PART = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class MixtralNames(RenamedReader):
    """A checkpoint reader view that answers raymoe's expert names (``experts.E.gate_proj.weight`` ...) with
    Mixtral's on-disk tensors (``experts.E.w1.weight`` ..., FP8 scales ``w1.weight_scale_inv`` likewise); every other
    name passes through unchanged."""

    @staticmethod
    def disk_name(name: str) -> str:
        """The on-disk name of ``name``."""
        m = _EXPERT.match(name)
        return f"{m.group(1)}.{_MIXTRAL_PART[m.group(2)]}.{m.group(3)}" if m else name


class MixtralForCausalLM(MoeCausalLM):
    """The whole Mixtral model on one rank.

    Args:
        config: normalized model config. groups: the rank's process groups. dtype: parameter dtype.
        ops: the rank's platform. a2a_backend: MoE all-to-all backend. enable_sbo: single-batch overlap.
        expert_location: the EP group's physical expert slots (``raymoe.eplb``; None: one slot per expert).
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 a2a_backend: str = "torch", enable_sbo: bool = False,
                 expert_location: ExpertLocation | None = None):
        super().__init__(config, groups, dtype, ops, enable_sbo)
        rotary = RotaryEmbedding(config, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(i, Qwen3MoeAttention(config, i, groups, rotary, dtype, ops, qk_norm=False),
                         build_mlp(config, i, groups, dtype, ops, a2a_backend, "block_sparse_moe",
                                   expert_location=expert_location), config.hidden_size,
                         config.rms_norm_eps, dtype, ops, mlp_name="block_sparse_moe")
            for i in range(config.num_hidden_layers))
        self.num_local_heads = self.layers[0].self_attn.num_heads
        self.num_local_kv_heads = self.layers[0].self_attn.num_kv_heads

    @torch.no_grad()
    def load_weights(self, reader) -> None:
        """Load this rank's shard; expert tensors are read under Mixtral's ``w1/w3/w2`` names.

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape (names the on-disk tensor).
        """
        super().load_weights(MixtralNames(reader))
