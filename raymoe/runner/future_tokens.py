"""FutureTokenMap: the rank-side half of overlap scheduling (after SGLang's ``FutureMap``).

The driver forms step N+1 while the ranks still compute step N, so a decode row of step N+1 cannot carry the token
step N samples for it. It carries a placeholder instead: ``-(i + 1)`` for row ``i`` of step N (of the same DP
group; ``raymoe.scheduler.req``). Each rank keeps the ids it sampled in its latest step in a device buffer and
swaps the placeholders of the next step's ``input_ids`` for them before the forward, on the device, without a host
sync. Ranks run their steps in the order the driver sent them, so "the latest step" is always step N.

Every rank of a DP group samples the same ids (identical logits, the same seeded generators), so each resolves
from its own buffer. Reading a row the previous step did not sample (it failed, say) gives a stale id, never an
error: the driver fails that step's requests anyway.
"""

from __future__ import annotations

import torch


class FutureTokenMap:
    """Sampled ids of the rank's latest step, for placeholder resolution.

    Args:
        max_rows: most rows a step can have (the ReqToTokenPool rows). device: the rank's device.
    """

    def __init__(self, max_rows: int, device: torch.device | str):
        self.ids = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def store(self, next_token_ids: torch.Tensor) -> None:
        """Keep ``next_token_ids`` ([bs] int64) as the latest step's tokens (the buffer grows past ``max_rows``
        when a caller sends more rows, which the driver never does)."""
        n = next_token_ids.shape[0]
        if n > self.ids.shape[0]:
            self.ids = torch.zeros(n, dtype=torch.int64, device=self.ids.device)
        self.ids[:n].copy_(next_token_ids)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ([T] int64) with every placeholder ``-(i + 1)`` replaced by row ``i`` of the latest
        step's tokens (device ops only; a new tensor)."""
        rows = (-input_ids - 1).clamp_(0, self.ids.shape[0] - 1)
        return torch.where(input_ids < 0, self.ids[rows], input_ids)
