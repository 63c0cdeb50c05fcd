"""An EAGLE-style draft head for a grouped-query-attention target (Qwen3-MoE): ``speculative_algorithm="eagle"``.

EAGLE (Li, Wei, Zhang, Zhang, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML 2024)
drafts at the level of the target's features: at position ``j`` a single decoder layer reads the target's hidden
state ``h_j`` and the embedding of the next token ``x_{j+1}`` through one projection,
``x = fc([emb(x_{j+1}); h_j])``, and its output, normed and put through the *target's* LM head, predicts
``x_{j+2}``; the output also stands in for ``h`` at the next position, so the head drafts a chain. It is a separate
small checkpoint (``speculative_draft_model_path``) in EAGLE's layout: ``fc.weight`` [H, 2H], ``norm.weight`` and
``layers.0.*`` (a dense decoder layer: ``self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``), with a ``config.json`` naming its
``intermediate_size``; the embedding and the LM head are the target's. ``raymoe make-checkpoint --arch eagle
--target DIR`` trains one (``raymoe.models.train_eagle.train_eagle_head``); the target hidden states it reads are the
target's final normed ones, as for DeepSeek's MTP layer.

Its attention keeps its keys in one more KV cache layer of the target's pool (``num_hidden_layers``), at the
target's slots; its MLP is dense (no expert-parallel collectives); the drafter runs it like the MTP layer
(``raymoe.runner.mtp_drafter``).
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.layers.moe import DenseMLP
from raymoe.layers.norm import RMSNorm
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, load_norm
from raymoe.models.draft_layer import load_matrix, run_decoder_layer
from raymoe.models.qwen3_moe import Qwen3MoeAttention
from raymoe.platform.interface import Platform


class EagleHead(nn.Module):
    """The draft head on one rank (module docstring).

    Args:
        target: the target's config (attention sizes, rotary, vocabulary). intermediate_size: the head's MLP width.
        groups, dtype, ops: the rank's. embed_tokens, lm_head: the target's (shared, not owned).
    """

    def __init__(self, target: ModelConfig, intermediate_size: int, groups: ParallelGroups, dtype: torch.dtype,
                 ops: Platform, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        h, layer_id = target.hidden_size, target.num_hidden_layers
        self.shared = [embed_tokens, lm_head]  # a list keeps them out of this module's parameters
        self.fc = nn.Parameter(torch.empty(h, 2 * h, dtype=dtype), requires_grad=False)
        attn = Qwen3MoeAttention(target, layer_id, groups, RotaryEmbedding(target, dtype), dtype, ops)
        self.layer = DecoderLayer(layer_id, attn, DenseMLP(h, intermediate_size, groups, dtype, ops), h,
                                  target.rms_norm_eps, dtype, ops)
        self.norm = RMSNorm(h, target.rms_norm_eps, dtype, ops)

    def forward(self, forward_batch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``input_ids`` [T] (the token after each position), ``hidden`` [T, H] (the target's, or the head's own
        output) -> the head's output hidden states [T, H] (its KV written at ``forward_batch.out_cache_loc``)."""
        x = torch.nn.functional.linear(torch.cat([self.shared[0](input_ids), hidden], dim=-1), self.fc)
        return run_decoder_layer(self.layer, x, forward_batch)

    def logits(self, hidden: torch.Tensor, rows_per_rank: int | None = None) -> torch.Tensor:
        """Draft logits, float32 [N, vocab], through the head's norm and the target's LM head (``rows_per_rank``:
        as ``DeepseekMTP.logits``)."""
        return self.shared[1](self.norm(hidden), rows_per_rank).float()

    def load(self, reader) -> None:
        """``fc.weight``, ``norm.weight`` and ``layers.0.*`` from the head's folder.

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape.
        """
        load_matrix(self.fc, reader, "fc.weight")
        load_norm(self.norm, reader, "norm.weight")
        self.layer.load(reader, "layers.0")
