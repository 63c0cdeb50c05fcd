"""Static input buffers of the decode graphs (owned by one ``GraphRunner``).

A captured graph reads its inputs from fixed addresses, so every bucket's ``ForwardBatch`` is a set of views of
the first ``bs`` rows of these buffers. Before a replay, :meth:`GraphInputBuffers.populate` copies the real
batch into rows ``[0, n)`` and writes padding into rows ``[n, bs)``.

There is one buffer per device tensor of ``ForwardBatch`` (``TOKEN_TENSORS + ROW_TENSORS``; a decode step has
one token per row, so both kinds are [max_bs]); :data:`PADDING` is the one table of their padding values.
Rows past ``bs`` are never read by bucket ``bs``, so they may hold anything (e.g. a larger earlier batch).
``ForwardBatch.padding_mask`` has its own bool buffer, True on rows ``[n, bs)``: the MoE layers give those rows
no expert, so the dispatch sends exactly the real rows' pairs (``raymoe.layers.moe``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from raymoe.runner.forward_batch import ForwardBatch
from raymoe.step.forward_mode import ForwardMode

DUMMY_SLOT = 0  # TokenToKVPool row reserved for padding writes (see raymoe.kvcache.pools)


class Pad(Enum):
    """Padding values that are not a plain number."""

    SEQ_LEN_FILL = "the attention backend's get_cuda_graph_seq_len_fill_value()"
    CONSTANT = "never written after create(): arange(max_bs), since a decode step samples every row"


PADDING: dict[str, int | Pad] = {
    "input_ids": 0,                  # any valid token; the row's output is dropped
    "positions": 0,
    "out_cache_loc": DUMMY_SLOT,     # padding keys/values never land in a real KV slot
    "req_pool_indices": 0,           # row 0 of the table is only read, never written, by a decode forward
    "seq_lens": Pad.SEQ_LEN_FILL,
    "sample_indices": Pad.CONSTANT,
}
_FIELDS = ForwardBatch.TOKEN_TENSORS + ForwardBatch.ROW_TENSORS
if set(PADDING) != set(_FIELDS):
    raise RuntimeError(f"graph_buffers.PADDING must name exactly ForwardBatch's tensors {_FIELDS}, "
                       f"got {tuple(PADDING)}")


@dataclass
class GraphInputBuffers:
    """Fixed-address decode inputs for up to ``max_bs`` rows.

    Attributes:
        tensors: one [max_bs] int64 buffer per name in :data:`PADDING`.
        seq_len_fill_value: sequence length of padding rows, tokens.
        padding_mask: [max_bs] bool, True on padding rows (``ForwardBatch.padding_mask``).
    """

    tensors: dict[str, torch.Tensor]
    seq_len_fill_value: int
    padding_mask: torch.Tensor

    @classmethod
    def create(cls, max_bs: int, device: torch.device | str, seq_len_fill_value: int) -> GraphInputBuffers:
        """Allocate buffers for ``max_bs`` rows on ``device``, all rows set to padding."""
        tensors = {name: torch.zeros(max_bs, dtype=torch.int64, device=device) for name in _FIELDS}
        tensors["sample_indices"].copy_(torch.arange(max_bs, dtype=torch.int64, device=device))
        bufs = cls(tensors=tensors, seq_len_fill_value=seq_len_fill_value,
                   padding_mask=torch.ones(max_bs, dtype=torch.bool, device=device))
        bufs.pad(0, max_bs)
        return bufs

    @property
    def max_bs(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    def pad(self, start: int, end: int) -> None:
        """Write padding values into rows ``[start, end)`` (constant buffers are left as they are) and mark them as
        padding."""
        if end <= start:
            return
        self.padding_mask[start:end].fill_(True)
        for name, buf in self.tensors.items():
            value = PADDING[name]
            if value is Pad.CONSTANT:
                continue
            buf[start:end].fill_(self.seq_len_fill_value if value is Pad.SEQ_LEN_FILL else value)

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
            for name, buf in self.tensors.items():
                if PADDING[name] is not Pad.CONSTANT:
                    buf[:n].copy_(getattr(fb, name))
            self.padding_mask[:n].fill_(False)
        self.pad(n, bs)
        return list(fb.seq_lens_cpu) + [self.seq_len_fill_value] * (bs - n)

    def forward_batch(self, bs: int, attn_backend, use_tbo: bool) -> ForwardBatch:
        """The static DECODE ``ForwardBatch`` of bucket ``bs``: views of rows ``[0, bs)``.

        Its host lists describe an all-padding batch and are frozen at capture time: a graph cannot see
        host values that change between replays, so nothing in the forward may depend on them.
        """
        fill = self.seq_len_fill_value
        views = {name: buf[:bs] for name, buf in self.tensors.items()}
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, **views, req_pool_indices_cpu=[0] * bs,
            seq_lens_cpu=[fill] * bs, prefix_lens_cpu=[fill - 1] * bs, extend_lens_cpu=[1] * bs, sampling=None,
            attn_backend=attn_backend, use_tbo=use_tbo, graph_bs=bs, padding_mask=self.padding_mask[:bs],
        )
