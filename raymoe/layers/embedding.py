"""Vocabulary-parallel embedding and LM head.

The vocabulary is padded to a multiple of the shard count and split in contiguous row ranges; shard r holds rows
``[r * V_local, (r + 1) * V_local)``. Padding rows are zero and their logits are cut off. Shards are the TP group's
ranks, except for an LM head under attention data parallelism (``tp_size == 1``, ``ep_size > 1``), which is split
over the EP group (every rank) as SGLang splits it under DP attention: see :class:`ParallelLMHead`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raymoe.comm.ep_transport import ep_transport_of
from raymoe.comm.groups import ParallelGroups, tp_all_gather_last_dim, tp_all_reduce
from raymoe.errors import CheckpointError
from raymoe.platform.interface import Platform, WeightKind


class VocabParallelEmbedding(nn.Module):
    """Token embedding sharded by vocabulary rows. ``ids`` [T] int64 -> [T, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, groups: ParallelGroups, dtype: torch.dtype,
                 shards: int | None = None, shard_rank: int | None = None):
        """``shards``/``shard_rank``: how many vocabulary shards and which this rank holds (default: the TP
        group's size and rank)."""
        super().__init__()
        self.groups = groups
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // (groups.tp_size if shards is None else shards))
        self.start = (groups.tp_rank if shard_rank is None else shard_rank) * self.vocab_local
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
    """Output projection sharded by vocabulary rows. ``hidden`` [N, H] -> logits [N, vocab] of those rows.

    With tensor parallelism the TP ranks share the rows and all-gather their logits. Under attention data
    parallelism (``tp_size == 1`` and ``ep_size > 1``: every rank holds its own requests, and a replicated head
    would stream all V x H weights on every rank each step) the head is split over the EP group instead, as SGLang
    does under DP attention: each rank all-gathers every rank's rows (padded to the step's common row count),
    computes their logits over its ``V / ep`` vocabulary rows, and an equal-split all-to-all returns each rank its
    own rows' slices. Each rank then streams ``1 / ep`` of the weights; the price is two small exchanges per
    forward, which every rank of the group must enter (an IDLE rank with zero rows too).
    """

    def __init__(self, vocab_size: int, hidden_size: int, groups: ParallelGroups, dtype: torch.dtype, ops: Platform):
        split = groups.tp_size == 1 and groups.ep_size > 1
        super().__init__(vocab_size, hidden_size, groups, dtype, *((groups.ep_size, groups.ep_rank) if split else ()))
        self.split_over_dp = split
        self.transport = ep_transport_of(groups) if split else None
        self.ops = ops
        self.prepared = None

    def load(self, reader, name: str) -> None:
        """Read this shard's rows of ``name`` ([vocab, hidden]), then let the platform prepare them for the head
        (``WeightKind.LM_HEAD``: a CPU rank stores them column-major and keeps a packed copy).

        Raises:
            CheckpointError: the tensor's shape is not [vocab, hidden].
        """
        super().load(reader, name)
        self.prepared = self.ops.prepare_weight(self.weight, WeightKind.LM_HEAD)

    def forward(self, hidden: torch.Tensor, rows_per_rank: int | None = None) -> torch.Tensor:  # type: ignore[override]
        """Logits [N, vocab] of ``hidden`` [N, H].

        ``rows_per_rank``: under the DP split, an upper bound of N that every rank of the step shares (the decode
        dispatch capacity; a CUDA graph needs it fixed). None: the ranks exchange their N to find it (a blocking
        exchange with a host sync). Ignored otherwise.
        Raises:
            ValueError: N is above ``rows_per_rank``.
        """
        if self.transport is None:
            logits = self.ops.linear(hidden, self.weight, self.prepared)
            logits = tp_all_gather_last_dim(logits, self.groups)
            return logits[..., : self.vocab_size]
        n, h = hidden.shape
        ep = self.groups.ep_size
        if rows_per_rank is None:
            rows_per_rank = self.transport.exchange_counts(torch.full((ep,), n, dtype=torch.int64))[2]
        m = rows_per_rank
        if n > m:
            raise ValueError(f"LM head got {n} rows, above the {m} rows per rank the step planned")
        send = hidden.contiguous() if n == m else torch.cat((hidden, hidden.new_zeros(m - n, h)))
        gathered = hidden.new_empty((ep * m, h))                                # rank s's rows at [s * m, (s+1) * m)
        self.transport.all_gather(gathered, send).wait()
        part = self.ops.linear(gathered, self.weight, self.prepared)             # [ep * m, V_local]
        mine = torch.empty_like(part)
        self.transport.all_to_all_equal(mine, part).wait()                      # chunk s: my rows, shard s's columns
        logits = mine.view(ep, m, self.vocab_local).transpose(0, 1).reshape(m, ep * self.vocab_local)
        return logits[:n, : self.vocab_size]
