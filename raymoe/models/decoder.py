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
from raymoe.errors import CheckpointError
from raymoe.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from raymoe.layers.moe import DenseMLP, SparseMoeBlock
from raymoe.layers.norm import RMSNorm, add_rms_norm
from raymoe.overlap.forward import forward_layers
from raymoe.overlap.operations import ForwardState
from raymoe.platform.cpu.kernels import attn_block, cpu_ops
from raymoe.platform.cpu.kernels.attn_block import AttnBlockPlan


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


def build_mlp(config: ModelConfig, layer_id: int, groups: ParallelGroups, dtype: torch.dtype,
              a2a_backend: str | A2ABackendSpec) -> nn.Module:
    """The layer's MLP: a ``SparseMoeBlock`` (with the config's router and shared experts) for MoE layers, else a
    tensor-parallel ``DenseMLP`` of ``intermediate_size``."""
    if not config.is_moe_layer(layer_id):
        return DenseMLP(config.hidden_size, config.intermediate_size, groups, dtype)
    return SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                          config.moe_intermediate_size, config.router.norm_topk_prob, groups, dtype, a2a_backend,
                          router=config.router,
                          shared_intermediate_size=config.n_shared_experts * config.moe_intermediate_size)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; ``state.hidden_states`` [T, H] in and out.

    Args:
        layer_id: layer index. self_attn: attention module with ``op_prepare``/``op_core``/``load``.
        mlp: ``SparseMoeBlock`` or ``DenseMLP``. hidden_size, eps: of the two RMSNorms. dtype: parameter dtype.
        mlp_name: checkpoint name of the MLP (``"mlp"``; Mixtral: ``"block_sparse_moe"``).
    """

    def __init__(self, layer_id: int, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 dtype: torch.dtype, mlp_name: str = "mlp"):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = self_attn
        self.mlp = mlp
        self.is_moe = isinstance(mlp, SparseMoeBlock)
        self.mlp_name = mlp_name
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)
        self._attn_block: AttnBlockPlan | bool | None = None  # built on first use; False: this layer cannot fuse

    def op_comm_prepare_attn(self, state: ForwardState) -> None:
        state.residual = state.hidden_states
        state.hidden_states = self.input_layernorm(state.hidden_states)

    def op_comm_prepare_mlp(self, state: ForwardState) -> None:
        norm = self.post_attention_layernorm
        state.hidden_states, state.residual = add_rms_norm(state.hidden_states, state.residual, norm.weight,
                                                           norm.eps)

    def op_dense_mlp(self, state: ForwardState) -> None:
        state.moe_output = self.mlp(state.hidden_states)

    def op_comm_postprocess_layer(self, state: ForwardState) -> None:
        state.hidden_states = state.residual + state.moe_output
        state.residual = state.moe_output = None

    def op_attn_block(self, state: ForwardState) -> None:
        """:meth:`attn_half_operations` as one fused kernel call (``raymoe.platform.cpu.kernels.attn_block``) on a float32 CPU
        rank whose attention and router the kernel covers, for a step within ``ATTN_BLOCK_MAX_MACS`` whose
        tokens the backend attends with its paged kernel (``block_attention_inputs``); otherwise those ops in
        turn."""
        fb = state.forward_batch
        x = state.hidden_states
        plan = self._attn_block_plan()
        inputs = None
        if (plan is not None and state.residual is None and 0 < x.shape[0] * plan.macs_per_row
                <= attn_block.ATTN_BLOCK_MAX_MACS and cpu_ops.enabled_for(x)):
            inputs = fb.attn_backend.block_attention_inputs(self.layer_id, fb)
        if inputs is None:
            for op in self.attn_half_operations():
                op(state)
            return
        state.residual, state.hidden_states, weights, ids = plan(x, fb.positions, fb.out_cache_loc, inputs)
        if self.is_moe:
            state.topk_weights, state.topk_ids = weights, ids

    def _attn_block_plan(self) -> AttnBlockPlan | None:
        """This layer's fused block (built once: the weights are checked, and the projections' packed copies are
        taken from their layers), or None when its attention or router is not one the kernel covers, its weights
        are not float32 CPU tensors, or its projections are too large for a step of ``ATTN_BLOCK_MIN_ROWS`` rows
        to fit ``ATTN_BLOCK_MAX_MACS`` (a model the block would rarely serve gains nothing from it)."""
        if self._attn_block is None:
            self._attn_block = False
            weights = getattr(self.self_attn, "attn_block_weights", lambda: None)()
            router = self.mlp.fused_router() if self.is_moe else {}
            if weights is not None and router is not None and attn_block.plan_fits(weights, router):
                norms = (self.input_layernorm, self.post_attention_layernorm)
                tensors = [n.weight for n in norms] + [t for t in (*weights.values(), *router.values())
                                                       if isinstance(t, torch.Tensor)]
                if norms[0].eps == norms[1].eps and cpu_ops.enabled_for(*tensors):
                    self._attn_block = AttnBlockPlan(ln1_w=norms[0].weight, ln2_w=norms[1].weight,
                                                     norm_eps=norms[0].eps, **weights, **router)
        return self._attn_block or None

    def _apply(self, fn, *args, **kwargs):
        self._attn_block = None  # a device or dtype change moves the weights the plan points at
        return super()._apply(fn, *args, **kwargs)

    def attn_half_operations(self) -> list:
        """The ops from the input norm to the MoE routing (to the post-attention norm for a dense MLP)."""
        routing = self.mlp.routing_operations() if self.is_moe else []
        return [self.op_comm_prepare_attn, self.self_attn.op_prepare, self.self_attn.op_core,
                self.op_comm_prepare_mlp, *routing]

    def operations(self) -> list:
        """This layer's op list in execution order (no yields; strategies insert them)."""
        mlp_ops = self.mlp.expert_operations() if self.is_moe else [self.op_dense_mlp]
        return [*self.attn_half_operations(), *mlp_ops, self.op_comm_postprocess_layer]

    def plain_operations(self) -> list:
        """:meth:`operations` for a step without overlap; where the layer has a fused block plan (a float32 CPU
        layer the kernel covers), the attention half as one op (:meth:`op_attn_block`), which no overlap schedule
        splits. Other layers (CUDA, other dtypes, MLA) keep the fine ops, with nothing added per step."""
        if self._attn_block_plan() is None:
            return self.operations()
        mlp_ops = self.mlp.expert_operations() if self.is_moe else [self.op_dense_mlp]
        return [self.op_attn_block, *mlp_ops, self.op_comm_postprocess_layer]

    def load(self, reader, prefix: str) -> None:
        self.self_attn.load(reader, f"{prefix}.self_attn")
        self.mlp.load(reader, f"{prefix}.{self.mlp_name}")
        load_norm(self.input_layernorm, reader, f"{prefix}.input_layernorm.weight")
        load_norm(self.post_attention_layernorm, reader, f"{prefix}.post_attention_layernorm.weight")
        self._attn_block = None


def gqa_kv_pool(config: ModelConfig, num_kv_heads: int, num_slots: int, dtype: torch.dtype,
                device: torch.device | str):
    """Per-head K/V cache (``TokenToKVPool``) of ``num_kv_heads`` local kv heads of ``config.head_dim``."""
    from raymoe.kvcache.pools import TokenToKVPool

    return TokenToKVPool(num_slots, config.num_hidden_layers, num_kv_heads, config.head_dim, dtype, device)


def gqa_attn_backend(name: str, req_to_token_pool, token_to_kv_pool, num_heads: int, num_kv_heads: int,
                     head_dim: int):
    """The registry's backend ``name`` for grouped-query attention (``raymoe.attention.base``)."""
    from raymoe.attention.base import get_attention_backend

    return get_attention_backend(name, req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool,
                                 num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


class MoeCausalLM(nn.Module):
    """Embedding -> decoder layers -> RMSNorm -> LM head, on one rank. Subclasses build ``self.layers`` (a
    ``ModuleList`` of :class:`DecoderLayer`) after calling this constructor, and define the KV pool/backend
    factories ``create_kv_pool`` / ``create_attn_backend`` the runner calls.

    Args:
        config: normalized model config. groups: the rank's process groups. dtype: parameter/activation dtype.
        enable_sbo: single-batch overlap inside MoE layers (same on every rank).

    Attributes:
        tbo_decode_schedule: ``"fine"`` or ``"coarse"`` stage boundaries of DECODE two-batch-overlap steps
            (``raymoe.overlap.strategy``); the runner sets it from ``OverlapConfig.tbo_decode_schedule``.
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, enable_sbo: bool):
        super().__init__()
        self.config = config
        self.enable_sbo = enable_sbo
        self.tbo_decode_schedule = "fine"
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, groups, dtype)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, groups, dtype)
        self.layers = nn.ModuleList()

    def create_kv_pool(self, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        """KV cache of ``num_slots`` tokens for this rank (GQA models: per-head K/V of the local kv heads)."""
        return gqa_kv_pool(self.config, self.num_local_kv_heads, num_slots, dtype, device)

    def create_attn_backend(self, name: str, req_to_token_pool, token_to_kv_pool):
        """Attention backend ``name`` over this model's cache (GQA models: the registry's backend)."""
        return gqa_attn_backend(name, req_to_token_pool, token_to_kv_pool, self.num_local_heads,
                                self.num_local_kv_heads, self.config.head_dim)

    def embed(self, forward_batch) -> ForwardState:
        """Start a forward: embeddings of ``forward_batch.input_ids`` [T] -> state with hidden_states [T, H]."""
        return ForwardState(hidden_states=self.embed_tokens(forward_batch.input_ids), residual=None,
                            forward_batch=forward_batch)

    def forward(self, forward_batch) -> torch.Tensor:
        """All layers (two-batch overlapped when ``forward_batch.tbo_children`` is set) -> final-normed [T, H]."""
        state = forward_layers(self.layers, self.embed(forward_batch), self.enable_sbo, self.tbo_decode_schedule)
        return self.norm(state.hidden_states)

    def compute_logits(self, hidden: torch.Tensor, rows_per_rank: int | None = None) -> torch.Tensor:
        """LM head: [N, H] -> float32 logits [N, vocab]. ``rows_per_rank``: a bound of N shared by every rank of
        the step, for a head split over DP ranks (:class:`~raymoe.layers.embedding.ParallelLMHead`); None: found
        by an exchange when the head needs it."""
        return self.lm_head(hidden, rows_per_rank).float()

    @torch.no_grad()
    def load_weights(self, reader) -> None:
        """Load this rank's shard from a ``CheckpointReader``.

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape (names the tensor).
        """
        self.embed_tokens.load(reader, "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"model.layers.{i}")
        load_norm(self.norm, reader, "model.norm.weight")
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head.load(reader, head)
