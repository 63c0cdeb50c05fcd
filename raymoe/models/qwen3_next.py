"""Qwen3-Next (Qwen team; transformers ``Qwen3NextForCausalLM``, ``model_type`` ``qwen3_next``): the same layer types
as Qwen3.5-MoE (``raymoe.models.qwen3_5_moe``: Gated DeltaNet linear attention, gated full attention, MoE with a
gated shared expert, zero-centered RMSNorms), with two differences this module bridges:

* **Fused, head-grouped input projections.** A Gated DeltaNet layer stores ``in_proj_qkvz`` [Hk (2 Dk + 2 r Dv), H]
  and ``in_proj_ba`` [Hk 2 r, H] (``r = Hv / Hk`` value heads per key head): for each key head in turn, its query,
  key, its ``r`` value heads and their ``r`` output-gate heads (and its ``r`` b then ``r`` a rows). Qwen3.5 stores
  the same rows as separate ``in_proj_qkv`` (all queries, all keys, all values), ``in_proj_z``, ``in_proj_b`` and
  ``in_proj_a``. :class:`GroupedProjectionNames` answers the Qwen3.5 names by regrouping the rows (a permutation
  of rows, exact), so the layers, their tensor-parallel split and their kernels are Qwen3.5's.
* **Dense layers.** ``mlp_only_layers`` and ``decoder_sparse_step`` choose layers with a dense SwiGLU MLP of
  ``intermediate_size`` instead of a MoE block; the router renormalizes its top-k weights iff ``norm_topk_prob``
  (Qwen3.5 always does).

The released checkpoints' MTP layer (``mtp.*``, ``num_nextn_predict_layers``) is Qwen3.5's
(``raymoe.models.qwen3_5_mtp``): ``nextn`` drafts with it.
"""

from __future__ import annotations

import torch

from raymoe.config_linear import LinearAttentionConfig
from raymoe.errors import CheckpointError
from raymoe.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

_PARTS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


class GroupedProjectionNames:
    """A checkpoint reader view (``get``, ``get_slice``, ``shape``, ``in``) that answers a Gated DeltaNet layer's
    Qwen3.5 names (``<layer>.linear_attn.in_proj_qkv.weight`` [2 Hk Dk + Hv Dv, H], ``in_proj_z`` [Hv Dv, H],
    ``in_proj_b`` / ``in_proj_a`` [Hv, H]) from Qwen3-Next's head-grouped ``in_proj_qkvz`` / ``in_proj_ba`` (module
    docstring); every other name passes through.

    Args:
        reader: a ``CheckpointReader``. linear: the model's (whole, not per-rank) linear-attention sizes.
    Raises (from ``get``):
        CheckpointError: a fused tensor is missing or its shape does not match ``linear``.
    """

    def __init__(self, reader, linear: LinearAttentionConfig):
        self.reader, self.lin = reader, linear

    @staticmethod
    def _split_name(name: str) -> tuple[str, str] | None:
        for part in _PARTS:
            if name.endswith(".linear_attn." + part):
                return name[:-len(part)], part
        return None

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        split = self._split_name(name)
        if split is None:
            return name in self.reader
        fused = "in_proj_qkvz.weight" if split[1] in _PARTS[:2] else "in_proj_ba.weight"
        return split[0] + fused in self.reader

    def _regroup(self, prefix: str, part: str, dtype: torch.dtype | None) -> torch.Tensor:
        lin = self.lin
        hk, r, dk, dv = lin.num_key_heads, lin.num_value_heads // lin.num_key_heads, lin.key_head_dim, \
            lin.value_head_dim
        if part in _PARTS[:2]:
            name, sizes = prefix + "in_proj_qkvz.weight", (dk, dk, r * dv, r * dv)
        else:
            name, sizes = prefix + "in_proj_ba.weight", (r, r)
        w = self.reader.get(name, dtype=dtype)
        if w.dim() != 2 or w.shape[0] != hk * sum(sizes):
            raise CheckpointError(name, f"shape {tuple(w.shape)} does not match {hk} key heads x {sum(sizes)} rows")
        groups = w.reshape(hk, sum(sizes), w.shape[1]).split(sizes, dim=1)   # each [Hk, rows per head, H]
        if part == "in_proj_qkv.weight":
            picked = groups[:3]
        else:
            picked = (groups[{"in_proj_z.weight": 3, "in_proj_b.weight": 0, "in_proj_a.weight": 1}[part]],)
        return torch.cat([g.reshape(-1, w.shape[1]) for g in picked])

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        split = self._split_name(name)
        return self.reader.get(name, dtype=dtype) if split is None else self._regroup(*split, dtype)

    def get_slice(self, name: str, dim: int, start: int, end: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._split_name(name) is None:
            return self.reader.get_slice(name, dim, start, end, dtype=dtype)
        return self.get(name, dtype).narrow(dim, start, end - start)

    def shape(self, name: str):
        split = self._split_name(name)
        if split is None:
            return self.reader.shape(name)
        prefix, part = split
        lin = self.lin
        hidden = self.reader.shape(prefix + ("in_proj_qkvz.weight" if part in _PARTS[:2] else "in_proj_ba.weight"))[1]
        rows = {"in_proj_qkv.weight": lin.conv_dim, "in_proj_z.weight": lin.value_dim}.get(part, lin.num_value_heads)
        return (rows, hidden)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """The whole Qwen3-Next model on one rank (arguments as ``raymoe.models.qwen3_moe.Qwen3MoeForCausalLM``);
    Qwen3.5-MoE's layers, read through :class:`GroupedProjectionNames`."""

    def load_weights(self, reader) -> None:
        """Load the weights.

        Raises:
            CheckpointError: a tensor is missing or has the wrong shape (names the tensor).
        """
        super().load_weights(GroupedProjectionNames(reader, self.config.hybrid.linear))
