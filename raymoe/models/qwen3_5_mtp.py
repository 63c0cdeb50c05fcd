"""The multi-token-prediction (MTP) layer Qwen3.5-MoE and Qwen3-Next checkpoints carry, as the draft model of
speculative decoding (``nextn``).

Like DeepSeek-V3's (``raymoe.models.deepseek_mtp``) it reads, at position ``j``, the target's final hidden state
``h_j`` and the embedding of the next token ``x_{j+1}``, here as ``fc([pre_fc_norm_embedding(emb(x_{j+1}));
pre_fc_norm_hidden(h_j)])`` (embedding first), runs one decoder layer of the target's full-attention kind (gated
attention over its own KV cache layer, a MoE block with a gated shared expert), and predicts ``x_{j+2}`` through
``norm`` and the target's LM head (shared; the checkpoint has no head of its own). Its norms are zero-centered like
the target's. Checkpoint names: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*``, ``mtp.norm`` (SGLang's and vLLM's ``Qwen3NextMTP`` read the same); the number of such layers is
``mtp_num_hidden_layers`` (Qwen3.5) or ``num_nextn_predict_layers`` (Qwen3-Next), and the first one drafts.

The layer has no linear attention, so drafting never touches the recurrent states; its attention keeps its keys in
the KV pool's layer after the target's full-attention layers.
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.layers.moe import SparseMoeBlock
from raymoe.layers.norm import RMSNorm
from raymoe.layers.rotary import RotaryEmbedding
from raymoe.models.draft_layer import load_matrix, run_decoder_layer
from raymoe.platform.interface import Platform


class Qwen35MTP(nn.Module):
    """One MTP layer on one rank (module docstring).

    Args:
        config: the model's config. groups, dtype, ops, a2a_backend: as the model's. rotary: the model's rotary
            embedding. kv_layer: the layer's index in the KV pool (after the target's full-attention layers).
        embed_tokens, lm_head: the model's (shared).
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform, a2a_backend,
                 rotary: RotaryEmbedding, kv_layer: int, embed_tokens: nn.Module, lm_head: nn.Module):
        from raymoe.models.qwen3_5_moe import Qwen35DecoderLayer, Qwen35GatedAttention

        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.shared = [embed_tokens, lm_head]  # the model's; a list keeps them out of this module's parameters
        self.pre_fc_norm_embedding = RMSNorm(h, eps, dtype, ops)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, dtype, ops)
        self.fc = nn.Parameter(torch.empty(h, 2 * h, dtype=dtype), requires_grad=False)
        layer_id = config.num_hidden_layers
        mlp = SparseMoeBlock(config.num_experts, config.num_experts_per_tok, h, config.moe_intermediate_size,
                             config.router.norm_topk_prob, groups, dtype, ops, a2a_backend, router=config.router,
                             shared_intermediate_size=config.hybrid.shared_expert_intermediate_size,
                             prefix="mtp.layers.0.mlp", shared_name="shared_expert", shared_gate=True)
        self.layer = Qwen35DecoderLayer(layer_id, Qwen35GatedAttention(config, layer_id, kv_layer, groups, rotary,
                                                                       dtype, ops),
                                        mlp, h, eps, dtype, ops, mixer_name="self_attn")
        self.norm = RMSNorm(h, eps, dtype, ops)

    def forward(self, forward_batch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One pass over ``forward_batch``'s positions: ``input_ids`` [T] (the token after each position) and
        ``hidden`` [T, H] (the target's, or this layer's own output, at each position) -> the layer's output
        hidden states [T, H] (its keys written at ``forward_batch.out_cache_loc`` in its KV layer)."""
        e = self.pre_fc_norm_embedding(self.shared[0](input_ids))
        x = torch.nn.functional.linear(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1), self.fc)
        return run_decoder_layer(self.layer, x, forward_batch)

    def logits(self, hidden: torch.Tensor, rows_per_rank: int | None = None) -> torch.Tensor:
        """The draft distribution's logits, float32 [N, vocab], of output hidden states [N, H]. ``rows_per_rank``:
        a bound of N every rank shares, for a head split over the DP ranks (a graph replay's bucket; None: found
        by an exchange, ``ParallelLMHead``)."""
        return self.shared[1](self.norm(hidden), rows_per_rank).float()

    def load(self, reader) -> None:
        """Load ``mtp.*`` (module docstring; zero-centered norms as ``1 + w``).

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape.
        """
        from raymoe.models.qwen3_5_moe import load_centered

        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            load_centered(getattr(self, norm).weight.data, reader, f"mtp.{norm}.weight")
        load_matrix(self.fc, reader, "mtp.fc.weight")
        self.layer.load(reader, "mtp.layers.0")
