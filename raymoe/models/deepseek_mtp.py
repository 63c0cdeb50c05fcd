"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft model for speculative decoding (``nextn``).

The layer (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 2.2) reads, at position ``j``, the target
model's final hidden state ``h_j`` and the embedding of the next token ``x_{j+1}``:
``x = eh_proj([enorm(emb(x_{j+1})); hnorm(h_j)])``, runs one decoder layer (MLA attention over its own KV cache
layer, a MoE block), and predicts ``x_{j+2}`` through ``shared_head.norm`` and ``shared_head.head``. Its output
hidden state stands in for ``h`` at the next position, so the same layer drafts a chain of tokens one after the
other (SGLang's ``NEXTN``, vLLM's ``deepseek_mtp``). Checkpoint names are DeepSeek's: ``model.layers.{L}.enorm``,
``hnorm``, ``eh_proj``, ``shared_head.{norm,head}`` and the decoder layer's own, with ``L = num_hidden_layers``.

Its attention keeps its keys in KV cache layer ``L`` (the model's pool has one layer more), at the same slots as the
target's positions: the entry of position ``j`` is the one that consumed ``x_{j+1}``. Its MoE block joins the
expert-parallel group like every MoE layer (every rank runs every MTP pass of a step, IDLE ranks with no tokens),
in the normal dispatch mode and without two-batch overlap; it is not part of expert load balancing.
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.layers.embedding import ParallelLMHead
from raymoe.layers.mla import MLAAttention
from raymoe.layers.norm import RMSNorm
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.decoder import DecoderLayer, build_mlp, load_norm
from raymoe.models.draft_layer import load_matrix, run_decoder_layer
from raymoe.platform.interface import Platform


class DeepseekMTP(nn.Module):
    """One MTP layer on one rank (module docstring).

    Args:
        config: the model's config (``num_nextn_predict_layers >= 1``). groups, dtype, ops, a2a_backend: as the
            model's. rotary: the model's rotary embedding. embed_tokens: the model's embedding (shared).
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 a2a_backend, rotary: RotaryEmbedding, embed_tokens: nn.Module):
        super().__init__()
        h, layer_id = config.hidden_size, config.num_hidden_layers
        self.layer_id = layer_id
        self.embed_tokens = [embed_tokens]  # shared with the model; a list keeps it out of this module's params
        self.enorm = RMSNorm(h, config.rms_norm_eps, dtype, ops)
        self.hnorm = RMSNorm(h, config.rms_norm_eps, dtype, ops)
        self.eh_proj = nn.Parameter(torch.empty(h, 2 * h, dtype=dtype), requires_grad=False)
        self.layer = DecoderLayer(layer_id, MLAAttention(config, layer_id, groups, rotary, dtype, ops),
                                  build_mlp(config, layer_id, groups, dtype, ops, a2a_backend),
                                  h, config.rms_norm_eps, dtype, ops)
        self.head_norm = RMSNorm(h, config.rms_norm_eps, dtype, ops)
        self.head = ParallelLMHead(config.vocab_size, h, groups, dtype, ops)

    def forward(self, forward_batch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One pass over ``forward_batch``'s positions: ``input_ids`` [T] (the token after each position) and
        ``hidden`` [T, H] (the target's, or this layer's own output, at each position) -> the layer's output
        hidden states [T, H] (its KV written at ``forward_batch.out_cache_loc`` in cache layer ``layer_id``)."""
        e = self.enorm(self.embed_tokens[0](input_ids))
        x = torch.nn.functional.linear(torch.cat([e, self.hnorm(hidden)], dim=-1), self.eh_proj)
        return run_decoder_layer(self.layer, x, forward_batch)

    def logits(self, hidden: torch.Tensor, rows_per_rank: int | None = None) -> torch.Tensor:
        """The draft distribution's logits, float32 [N, vocab], of output hidden states [N, H]. ``rows_per_rank``:
        a bound of N every rank shares, for a head split over the DP ranks (a graph replay's bucket; None: found
        by an exchange, ``ParallelLMHead``)."""
        return self.head(self.head_norm(hidden), rows_per_rank).float()

    def load(self, reader) -> None:
        """Load ``model.layers.{L}.*`` (module docstring).

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape.
        """
        p = f"model.layers.{self.layer_id}"
        load_norm(self.enorm, reader, f"{p}.enorm.weight")
        load_norm(self.hnorm, reader, f"{p}.hnorm.weight")
        load_matrix(self.eh_proj, reader, f"{p}.eh_proj.weight")
        self.layer.load(reader, p)
        load_norm(self.head_norm, reader, f"{p}.shared_head.norm.weight")
        self.head.load(reader, f"{p}.shared_head.head.weight")
