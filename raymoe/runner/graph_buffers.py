"""Static input buffers of the decode graphs (owned by one ``GraphRunner``).

A captured graph reads its inputs from fixed addresses, so every bucket's ``ForwardBatch`` is a set of views of
the first ``bs`` rows of these buffers. Before a replay, :meth:`GraphInputBuffers.populate` copies the real
batch into rows ``[0, n)`` and writes padding into rows ``[n, bs)``:

=================  ==========================================================================
buffer             padding value
=================  ==========================================================================
input_ids          0 (any valid token; the row's output is dropped)
positions          0
req_pool_indices   0 (row 0 of the table is only read, never written, by a decode forward)
seq_lens           the attention backend's ``get_cuda_graph_seq_len_fill_value()``
out_cache_loc      :data:`DUMMY_SLOT` (0), so padding keys/values never land in a real KV slot
=================  ==========================================================================

Rows past ``bs`` are never read by bucket ``bs``, so they may hold anything (e.g. a larger earlier batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.runner.forward_batch import ForwardBatch
from raymoe.step.forward_mode import ForwardMode

DUMMY_SLOT = 0  # TokenToKVPool row reserved for padding writes (see raymoe.kvcache.pools)


@dataclass
class GraphInputBuffers:
    """Fixed-address decode inputs for up to ``max_bs`` rows; every tensor is [max_bs] int64.

    ``sample_indices`` is the constant ``arange(max_bs)`` (decode samples every row).
    ``seq_len_fill_value``: sequence length of padding rows, tokens.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    sample_indices: torch.Tensor
    seq_len_fill_value: int

    @classmethod
    def create(cls, max_bs: int, device: torch.device | str, seq_len_fill_value: int) -> "GraphInputBuffers":
        """Allocate buffers for ``max_bs`` rows on ``device``, all rows set to padding."""
        def z() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int64, device=device)

        bufs = cls(input_ids=z(), positions=z(), req_pool_indices=z(), seq_lens=z(), out_cache_loc=z(),
                   sample_indices=torch.arange(max_bs, dtype=torch.int64, device=device),
                   seq_len_fill_value=seq_len_fill_value)
        bufs.pad(0, max_bs)
        return bufs

    @property
    def max_bs(self) -> int:
        return int(self.input_ids.shape[0])

    def pad(self, start: int, end: int) -> None:
        """Write padding values into rows ``[start, end)``."""
        if end <= start:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.req_pool_indices[start:end].zero_()
        self.seq_lens[start:end].fill_(self.seq_len_fill_value)
        self.out_cache_loc[start:end].fill_(DUMMY_SLOT)

    def populate(self, forward_batch: ForwardBatch, bs: int) -> list[int]:
        """Copy a decode (or IDLE, zero-row) batch of ``n <= bs`` rows into rows ``[0, n)`` and pad ``[n, bs)``.

        Returns:
            the padded sequence lengths of the ``bs`` rows on the host, tokens.
        Raises:
            ValueError: the batch has more rows than ``bs``, or not one token per row.
        """
        fb = forward_batch
        n = fb.batch_size
        if n > bs or bs > self.max_bs:
            raise ValueError(f"batch of {n} rows does not fit graph bucket {bs} (max {self.max_bs})")
        if fb.num_tokens != n:
            raise ValueError(f"a decode graph needs one token per row, got {fb.num_tokens} tokens for {n} rows")
        if n:
            self.input_ids[:n].copy_(fb.input_ids)
            self.positions[:n].copy_(fb.positions)
            self.req_pool_indices[:n].copy_(fb.req_pool_indices)
            self.seq_lens[:n].copy_(fb.seq_lens)
            self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        self.pad(n, bs)
        return list(fb.seq_lens_cpu) + [self.seq_len_fill_value] * (bs - n)

    def forward_batch(self, bs: int, attn_backend, use_tbo: bool) -> ForwardBatch:
        """The static DECODE ``ForwardBatch`` of bucket ``bs``: views of rows ``[0, bs)``.

        Its host lists describe an all-padding batch and are frozen at capture time: a graph cannot see
        host values that change between replays, so nothing in the forward may depend on them.
        """
        fill = self.seq_len_fill_value
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[:bs],
            sample_indices=self.sample_indices[:bs], req_pool_indices_cpu=[0] * bs, seq_lens_cpu=[fill] * bs,
            prefix_lens_cpu=[fill - 1] * bs, extend_lens_cpu=[1] * bs, sampling=None, attn_backend=attn_backend,
            use_tbo=use_tbo, graph_bs=bs,
        )
