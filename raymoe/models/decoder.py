"""Shared skeleton of pre-norm MoE decoders (DeepSeek-V2/V3, Mixtral): a decoder layer written as an op list and
a causal LM around it (embedding, layers, final norm, LM head, KV pool and attention backend factories).

A family supplies its attention module (``op_prepare``/``op_core``/``load``) and its MLP (a ``SparseMoeBlock`` or
a ``DenseMLP``); the layer's op list (DESIGN section 4) is the same for all of them.
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.comm.dispatcher import A2ABackendSpec
from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.eplb.location import ExpertLocation
from raymoe.errors import CheckpointError
from raymoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from raymoe.layers.moe import DenseMLP, SparseMoeBlock
from raymoe.layers.norm import RMSNorm
from raymoe.overlap.forward import LayerSchedules
from raymoe.overlap.operations import ForwardState, OpRole, stage_op
from raymoe.platform.interface import Platform


def load_norm(norm: RMSNorm | torch.Tensor, reader, name: str) -> None:
    """Copy a replicated norm weight [D] from the checkpoint into ``norm`` (an :class:`RMSNorm`, or a [..., D]
    tensor every row of which gets the weight: per-head norm weights stacked for several heads).

    Raises:
        CheckpointError: missing tensor or wrong shape.
    """
    dst = norm.weight.data if isinstance(norm, RMSNorm) else norm
    w = reader.get(name, dtype=dst.dtype)
    if tuple(w.shape) != tuple(dst.shape[-1:]):
        raise CheckpointError(name, f"shape {tuple(w.shape)} does not match {tuple(dst.shape[-1:])}")
    dst.copy_(w.expand_as(dst))


def moe_layer_ordinal(config: ModelConfig, layer_id: int) -> int:
    """The index of MoE layer ``layer_id`` among the model's MoE layers (0 = the first)."""
    return sum(config.is_moe_layer(i) for i in range(layer_id))


def expert_slots(config: ModelConfig, layer_id: int, groups: ParallelGroups,
                 expert_location: ExpertLocation | None) -> tuple[int | None, list[int] | None]:
    """MoE layer ``layer_id``'s physical expert slots (``raymoe.eplb``) and the logical expert each of this rank's
    slots holds; ``(None, None)`` without an expert location (one slot per expert)."""
    if expert_location is None:
        return None, None
    physical = expert_location.num_physical
    per_rank = physical // groups.ep_size
    row = expert_location.physical_to_logical[moe_layer_ordinal(config, layer_id)]
    return physical, list(row[groups.ep_rank * per_rank:(groups.ep_rank + 1) * per_rank])


def build_mlp(config: ModelConfig, layer_id: int, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
              a2a_backend: str | A2ABackendSpec, mlp_name: str = "mlp",
              expert_location: ExpertLocation | None = None) -> nn.Module:
    """The layer's MLP: a ``SparseMoeBlock`` (with the config's router and shared experts) for MoE layers, else a
    tensor-parallel ``DenseMLP`` of ``intermediate_size``; FP8 where ``config.quantization`` says so (checkpoint
    module ``model.layers.{layer_id}.{mlp_name}``). ``expert_location``: the EP group's physical expert slots
    (``raymoe.eplb``): this rank's slots and the logical experts they hold (None: one slot per expert)."""
    prefix = f"model.layers.{layer_id}.{mlp_name}"
    if not config.is_moe_layer(layer_id):
        return DenseMLP(config.hidden_size, config.intermediate_size, groups, dtype, ops,
                        quant=config.quantization, prefix=prefix)
    physical, slots = expert_slots(config, layer_id, groups, expert_location)
    return SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                          config.moe_intermediate_size, config.router.norm_topk_prob, groups, dtype, ops, a2a_backend,
                          router=config.router,
                          shared_intermediate_size=config.n_shared_experts * config.moe_intermediate_size,
                          quant=config.quantization, prefix=prefix, num_physical_experts=physical, slot_experts=slots)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; ``state.hidden_states`` [T, H] in and out.

    Args:
        layer_id: layer index. self_attn: attention module with ``op_prepare``/``op_core``/``load``.
        mlp: ``SparseMoeBlock`` or ``DenseMLP``. hidden_size, eps: of the two RMSNorms. dtype: parameter dtype.
        ops: the rank's platform. mlp_name: checkpoint name of the MLP (``"mlp"``; Mixtral: ``"block_sparse_moe"``).
    """

    def __init__(self, layer_id: int, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 dtype: torch.dtype, ops: Platform, mlp_name: str = "mlp"):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = self_attn
        self.mlp = mlp
        self.is_moe = isinstance(mlp, SparseMoeBlock)
        self.mlp_name = mlp_name
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype, ops)

    @stage_op(OpRole.ATTN_INPUT_NORM)
    def op_comm_prepare_attn(self, state: ForwardState) -> None:
        state.residual = state.hidden_states
        state.hidden_states = self.input_layernorm(state.hidden_states)

    @stage_op(OpRole.MLP_INPUT_NORM)
    def op_comm_prepare_mlp(self, state: ForwardState) -> None:
        state.hidden_states, state.residual = self.post_attention_layernorm.add_forward(state.hidden_states,
                                                                                        state.residual)

    def op_dense_mlp(self, state: ForwardState) -> None:
        state.moe_output = self.mlp(state.hidden_states)

    def op_comm_postprocess_layer(self, state: ForwardState) -> None:
        state.hidden_states = state.residual + state.moe_output
        state.residual = state.moe_output = None

    def operations(self) -> list:
        """This layer's op list in execution order (no yields; strategies insert them, a platform's fusions
        rewrite runs of it: ``raymoe.overlap.forward.LayerSchedules``)."""
        routing = self.mlp.routing_operations() if self.is_moe else []
        mlp_ops = self.mlp.expert_operations() if self.is_moe else [self.op_dense_mlp]
        return [self.op_comm_prepare_attn, self.self_attn.op_prepare, self.self_attn.op_core,
                self.op_comm_prepare_mlp, *routing, *mlp_ops, self.op_comm_postprocess_layer]

    def load(self, reader, prefix: str) -> None:
        self.self_attn.load(reader, f"{prefix}.self_attn")
        self.mlp.load(reader, f"{prefix}.{self.mlp_name}")
        load_norm(self.input_layernorm, reader, f"{prefix}.input_layernorm.weight")
        load_norm(self.post_attention_layernorm, reader, f"{prefix}.post_attention_layernorm.weight")


def gqa_kv_pool(config: ModelConfig, num_kv_heads: int, num_slots: int, dtype: torch.dtype,
                device: torch.device | str, extra_layers: int = 0):
    """Per-head K/V cache (``TokenToKVPool``) of ``num_kv_heads`` local kv heads of ``config.head_dim``, for the
    model's layers and ``extra_layers`` more (a draft model's, ``MoeCausalLM.extra_kv_layers``)."""
    from raymoe.kvcache.pools import TokenToKVPool

    return TokenToKVPool(num_slots, config.num_hidden_layers + extra_layers, num_kv_heads, config.head_dim, dtype,
                         device)


class MoeCausalLM(nn.Module):
    """Embedding -> decoder layers -> RMSNorm -> LM head, on one rank. Subclasses build ``self.layers`` (a
    ``ModuleList`` of :class:`DecoderLayer`) after calling this constructor, and define the KV pool/backend
    factories ``create_kv_pool`` / ``create_attn_backend`` the runner calls.

    Args:
        config: normalized model config. groups: the rank's process groups. dtype: parameter/activation dtype.
        ops: the rank's platform (every layer's arithmetic, attention backends, the fusions of plain forwards).
        enable_sbo: single-batch overlap inside MoE layers (same on every rank).

    Attributes:
        tbo_decode_schedule: ``"fine"`` or ``"coarse"`` stage boundaries of DECODE two-batch-overlap steps
            (``raymoe.overlap.strategy``); the runner sets it from ``OverlapConfig.tbo_decode_schedule``.
        extra_kv_layers: KV cache layers after the model's own, for a speculative draft model's attention (DeepSeek's
            MTP layer, an EAGLE head); set before ``create_kv_pool``.
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, ops: Platform,
                 enable_sbo: bool):
        super().__init__()
        self.config = config
        self.ops = ops
        self.enable_sbo = enable_sbo
        self.tbo_decode_schedule = "fine"
        self.extra_kv_layers = 0
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, groups, dtype)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, groups, dtype, ops)
        self.layers = nn.ModuleList()
        self._schedules: LayerSchedules | None = None  # op lists, built on first forward after a load

    def create_kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        """KV cache of ``num_slots`` tokens for this rank (GQA models: per-head K/V of the local kv heads)."""
        return gqa_kv_pool(self.config, self.num_local_kv_heads, num_slots, dtype, device, self.extra_kv_layers)

    def create_attn_backend(self, name: str, req_to_token_pool, token_to_kv_pool):
        """Attention backend ``name`` over this model's cache (GQA models: the platform's grouped-query backend)."""
        return self.ops.attention_backend(name, req_to_token_pool=req_to_token_pool,
                                          token_to_kv_pool=token_to_kv_pool, num_heads=self.num_local_heads,
                                          num_kv_heads=self.num_local_kv_heads, head_dim=self.config.head_dim)

    def embed(self, forward_batch) -> ForwardState:
        """Start a forward: embeddings of ``forward_batch.input_ids`` [T] -> state with hidden_states [T, H]."""
        return ForwardState(hidden_states=self.embed_tokens(forward_batch.input_ids), residual=None,
                            forward_batch=forward_batch)

    @property
    def schedules(self) -> LayerSchedules:
        """The layers' op lists per forward kind, built once after the weights were loaded (a platform's fusion
        reads the loaded weights)."""
        if self._schedules is None:
            self._schedules = LayerSchedules(list(self.layers), self.ops.fusions())
        return self._schedules

    def forward(self, forward_batch) -> torch.Tensor:
        """All layers (two-batch overlapped when ``forward_batch.tbo_children`` is set) -> final-normed [T, H]."""
        state = self.schedules.run(self.embed(forward_batch), self.enable_sbo, self.tbo_decode_schedule,
                                   self._tbo_streams(forward_batch))
        return self.norm(state.hidden_states)

    def _tbo_streams(self, forward_batch):
        """The platform's streams for a TBO step's children (``raymoe.overlap.streams``), or None: not a TBO step,
        a platform without streams, or a step whose MoE exchange receives through hooks (DeepEP low-latency)."""
        if forward_batch.tbo_children is None:
            return None
        streams = self.ops.tbo_streams()
        if streams is None:
            return None
        moe = next((layer.mlp for layer in self.layers if layer.is_moe), None)
        if moe is not None and moe.a2a.receives_through_hooks(forward_batch.dispatch_capacity):
            return None
        return streams

    def compute_logits(self, hidden: torch.Tensor, rows_per_rank: int | None = None) -> torch.Tensor:
        """LM head: [N, H] -> float32 logits [N, vocab]. ``rows_per_rank``: a bound of N shared by every rank of
        the step, for a head split over DP ranks (:class:`~raymoe.layers.embedding.ParallelLMHead`); None: found
        by an exchange when the head needs it."""
        return self.lm_head(hidden, rows_per_rank).float()

    def load_final_norm(self, reader) -> None:
        """The final RMSNorm's weight (families with zero-centered norms load ``1 + w``)."""
        load_norm(self.norm, reader, "model.norm.weight")

    @torch.no_grad()
    def load_weights(self, reader) -> None:
        """Load this rank's shard from a ``CheckpointReader``.

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape (names the tensor).
        """
        self.embed_tokens.load(reader, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{i}")
        self.load_final_norm(reader)
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head.load(reader, head)
        self._schedules = None
