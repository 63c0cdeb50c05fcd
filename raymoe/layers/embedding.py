"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of ``tp_size`` and split in contiguous row ranges; rank r holds rows
``[r * V_local, (r + 1) * V_local)``. Padding rows are zero and their logits are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raymoe.comm.groups import ParallelGroups, tp_all_gather_last_dim, tp_all_reduce
from raymoe.errors import CheckpointError


class VocabParallelEmbedding(nn.Module):
    """Token embedding sharded by vocabulary rows. ``ids`` [T] int64 -> [T, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, groups: ParallelGroups, dtype: torch.dtype):
        super().__init__()
        self.groups = groups
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // groups.tp_size)
        self.start = groups.tp_rank * self.vocab_local
        self.end = min(self.start + self.vocab_local, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.vocab_local, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.groups.tp_size == 1:
            return F.embedding(ids, self.weight)
        in_range = (ids >= self.start) & (ids < self.end)
        local = torch.where(in_range, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out, self.groups)

    def load(self, reader, name: str) -> None:
        """Read this rank's vocabulary rows of ``name`` ([vocab, hidden])."""
        shape = reader.shape(name)
        if tuple(shape) != (self.vocab_size, self.weight.shape[1]):
            raise CheckpointError(name, f"shape {tuple(shape)} does not match ({self.vocab_size}, "
                                        f"{self.weight.shape[1]})")
        rows = reader.get_slice(name, 0, self.start, self.end, dtype=self.weight.dtype)
        self.weight.data.zero_()
        self.weight.data[: rows.shape[0]].copy_(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded by vocabulary rows. ``hidden`` [N, H] -> logits [N, vocab] (all-gathered)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight)
        logits = tp_all_gather_last_dim(logits, self.groups)
        return logits[..., : self.vocab_size]
