"""RecurrentStatePool: the per-request recurrent states of a hybrid model's linear-attention layers, beside the KV
pools (SGLang keeps the same two tensors in its ``MambaPool``).

A Gated DeltaNet layer (``raymoe.layers.gated_delta``) carries, per request, the last ``K - 1`` inputs of its causal
conv (``conv`` [L, rows + 1, C, K - 1]) and its recurrent state (``ssm`` [L, rows + 1, Hv, Dk, Dv]), both float32.
Row ``r`` belongs to the request holding ``ReqToTokenPool`` row ``r``: it is allocated and freed with that row,
so the scheduler's row accounting (and the idle invariant's leaked-row count) covers it. A row is never cleared: a
request's first forward since its admission (``prefix_len == 0``; radix hits are off for hybrid models, so a
request with a prefix computed it in an earlier chunk of the same admission) starts from zeros and overwrites it.
The extra last row (``dummy_row``) takes the writes of a decode graph's padding rows, which read table row 0.
"""

from __future__ import annotations

import torch

from raymoe.config_linear import LinearAttentionConfig


class RecurrentStatePool:
    """Conv and recurrent states of ``num_layers`` linear-attention layers for ``rows`` request rows.

    Args:
        config: the layers' sizes (``value_dim``/``key_dim`` per rank: heads are not split).
        num_layers: linear-attention layers. rows: ReqToTokenPool rows. device: where the states live.
    Raises:
        ValueError: ``rows`` or ``num_layers`` below 1.
    """

    def __init__(self, config: LinearAttentionConfig, num_layers: int, rows: int, device: torch.device | str):
        if rows < 1 or num_layers < 1:
            raise ValueError(f"a recurrent state pool needs rows >= 1 and layers >= 1, got {rows}, {num_layers}")
        self.config, self.num_layers, self.rows = config, num_layers, rows
        self.dummy_row = rows
        self.conv = torch.zeros(num_layers, rows + 1, config.conv_dim, config.conv_kernel - 1, dtype=torch.float32,
                                device=device)
        self.ssm = torch.zeros(num_layers, rows + 1, config.num_value_heads, config.key_head_dim,
                               config.value_head_dim, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_row(config: LinearAttentionConfig, num_layers: int) -> int:
        """Bytes one request row holds over ``num_layers`` layers (float32 conv + recurrent states)."""
        per_layer = config.conv_dim * (config.conv_kernel - 1) + \
            config.num_value_heads * config.key_head_dim * config.value_head_dim
        return 4 * per_layer * num_layers

    def nbytes(self) -> int:
        """Bytes of both tensors."""
        return self.conv.numel() * 4 + self.ssm.numel() * 4


class VerifyStates:
    """A speculative verify step's candidate states (SGLang keeps the same per-draft intermediate states for hybrid
    models): a TARGET_VERIFY (or MIXED) row with ``k`` drafts advances every linear-attention layer over its newest
    token and the drafts, but only the newest token and the accepted drafts are final. Each layer stashes, for its
    rows with drafts, the conv and recurrent states after the newest token and after each draft; once the rank has
    accepted ``a`` drafts of a row (``raymoe.runner.spec_verify``), :meth:`commit` writes candidate ``a`` into the
    pool row. Everything stays on the device (no host read).

    Args:
        pool: the states' pool.
    """

    def __init__(self, pool: RecurrentStatePool):
        self.pool = pool
        self._stash: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def clear(self) -> None:
        """Forget what an earlier step stashed (a forward that raised before its commit)."""
        self._stash.clear()

    def stash(self, layer: int, rows: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Layer ``layer``'s candidates for request rows ``rows`` [R] int64: ``conv`` [R, k+1, C, K-1] and ``ssm``
        [R, k+1, Hv, Dk, Dv] float32, candidate ``j`` the state after the row's newest token and ``j`` drafts (rows
        with fewer drafts repeat their last candidate)."""
        self._stash.append((layer, rows, conv, ssm))

    def commit(self, batch_rows: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """Write each stashed row's candidate ``accept_lens[i]`` where ``batch_rows[i]`` is its request row
        (``batch_rows``, ``accept_lens``: [bs] int64 of the step's batch), then forget the stash."""
        if not self._stash:
            return
        at = torch.zeros(self.pool.rows + 1, dtype=torch.int64, device=accept_lens.device)
        at[batch_rows] = accept_lens
        for layer, rows, conv, ssm in self._stash:
            pick = at[rows].clamp(max=conv.shape[1] - 1)
            r = torch.arange(rows.shape[0], device=rows.device)
            self.pool.conv[layer].index_copy_(0, rows, conv[r, pick])
            self.pool.ssm[layer].index_copy_(0, rows, ssm[r, pick])
        self._stash.clear()
