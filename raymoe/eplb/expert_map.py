"""ExpertRouting: one MoE layer's logical -> physical expert map on a rank, and its expert-load counter.

The router chooses logical experts; with redundant experts (``ExpertLocation``) a logical expert may have several
physical slots, on several ranks. :meth:`ExpertRouting.to_physical` maps each routed pair to one of its replicas,
spread deterministically (the pair of token ``t`` in top-k column ``j`` takes replica ``(t + j + offset) %
replicas``: consecutive tokens alternate whatever ``k``), so replicas share a hot expert's pairs; every dispatch
path then carries physical ids, and since replicas hold the same weights and the
combine weights are unchanged, the output is the same as with one slot per expert. :meth:`ExpertRouting.count`
adds the step's routed pairs per logical expert to a counter on the device. Both are device operations on
fixed-shape tables updated in place (:meth:`ExpertRouting.update`), so a step stays free of host syncs and a
captured decode graph keeps reading the current tables (SGLang's expert location dispatch and expert distribution
recorder play these parts).
"""

from __future__ import annotations

import torch


class ExpertRouting:
    """Logical -> physical routing of one MoE layer, and its load counter.

    Args:
        table: [E, R] int64 physical slots per logical expert (R = ``ExpertLocation.max_replicas``; entries past an
            expert's replica count repeat its first slot). counts: [E] int64 replicas per expert (>= 1).
        load: [E + 1] int64 counter row (routed pairs per logical expert; the last entry counts ``NO_EXPERT``
            padding pairs), or None: not counted.
        offset: added to the pair index before choosing a replica (the rank's EP index: ranks start their spread
            on different replicas).
    """

    def __init__(self, table: torch.Tensor, counts: torch.Tensor, load: torch.Tensor | None, offset: int = 0):
        if table.dim() != 2 or counts.shape != table.shape[:1]:
            raise ValueError(f"ExpertRouting: table {tuple(table.shape)} and counts {tuple(counts.shape)} disagree")
        self.table = table
        self.counts = counts
        self.load = load
        self.offset = offset
        self.num_logical = table.shape[0]
        self.single = table.shape[1] == 1  # one slot per expert: a gather, no spread

    @classmethod
    def build(cls, table: list[list[int]], counts: list[int], load: torch.Tensor | None, offset: int,
              device: torch.device | str) -> ExpertRouting:
        """From host lists (``ExpertLocation.routing_table``) onto ``device``."""
        return cls(torch.tensor(table, dtype=torch.int64, device=device),
                   torch.tensor(counts, dtype=torch.int64, device=device), load, offset)

    def update(self, table: list[list[int]], counts: list[int]) -> None:
        """Switch to a new placement in place (same shapes: graphs keep reading these tensors).

        Raises:
            ValueError: the new table's shape differs.
        """
        new = torch.tensor(table, dtype=torch.int64)
        if tuple(new.shape) != tuple(self.table.shape):
            raise ValueError(f"ExpertRouting.update: table {tuple(new.shape)}, expected {tuple(self.table.shape)}")
        self.table.copy_(new)
        self.counts.copy_(torch.tensor(counts, dtype=torch.int64))

    def count(self, ids: torch.Tensor) -> None:
        """Add ``ids`` [T, k] int64 logical expert ids (``NO_EXPERT`` = -1 for padding) to the load counter."""
        if self.load is None or ids.numel() == 0:
            return
        flat = ids.reshape(-1).remainder(self.num_logical + 1)  # -1 -> E, the padding column
        self.load.index_add_(0, flat, torch.ones_like(flat))

    def to_physical(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [T, k] int64 logical (``NO_EXPERT`` kept) -> [T, k] int64 physical slots."""
        if ids.numel() == 0:
            return ids
        safe = ids.clamp(min=0)
        if self.single:
            phys = self.table[safe, 0]
        else:
            t, k = ids.shape
            spread = (torch.arange(t, device=ids.device).unsqueeze(1) + torch.arange(k, device=ids.device)
                      + self.offset)
            phys = self.table[safe, spread.remainder(self.counts[safe])]
        return torch.where(ids < 0, ids, phys)
