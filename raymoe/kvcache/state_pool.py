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
