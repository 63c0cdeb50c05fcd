"""Extend metadata of the torch MLA backend: the step's requests packed into a few tiles of flattened tokens.

A tile is a run of consecutive requests of an EXTEND/MIXED batch: its query tokens ``[q_start, q_end)`` of the
step (flattened, in request order), the cache slots of every request's whole sequence (cached prefix plus this
step's tokens) concatenated in the same order (``slots`` [S] int64), and one block-diagonal causal mask
``[q_end - q_start, S]`` bool over them: query ``j`` of request ``i`` (position ``prefix_i + j``) sees key ``p`` of
the same request when ``p <= prefix_i + j``, and no key of another request (segment ids, as varlen attention
kernels do with ``cu_seqlens``). The backend gathers and up-projects each tile's rows once and runs one SDPA
call per tile, so each cached row is expanded exactly once per layer and the Python loop runs over tiles, not
requests.

Tiles are cut so that ``queries x keys`` of a tile stays within ``max_tile_elems`` (the attention scores are
``heads x`` that many floats); a request larger than the budget alone is one tile (the per-request cost of a
plain SDPA call). The dense mask also scores a tile's queries against the other requests' keys (masked out): the
budget bounds that waste to ``heads x max_tile_elems`` scores per tile, while the up-projection of the tile's keys,
which every formulation pays, costs ``kv_lora_rank x heads x (qk_nope + v_head_dim)`` multiply-adds per key. All
masks and slots are built once per step, with tensor ops and no device-to-host copy, and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TILE_ELEMS = 1 << 16
"""Default budget of one tile: query tokens x key tokens (the scores are ``heads x`` this many values)."""


@dataclass(frozen=True)
class ExtendTile:
    """One tile (module docstring): query tokens ``[q_start, q_end)``, ``slots`` [S] int64 cache slots of its
    requests' sequences, ``mask`` [q_end - q_start, S] bool (True: attend), or None for a single query token
    over its own sequence (every key visible)."""

    q_start: int
    q_end: int
    slots: torch.Tensor
    mask: torch.Tensor | None

    def __post_init__(self):
        if not 0 <= self.q_start < self.q_end:
            raise ValueError(f"tile query range [{self.q_start}, {self.q_end}) is empty or negative")
        if self.mask is not None and tuple(self.mask.shape) != (self.q_end - self.q_start, self.slots.shape[0]):
            raise ValueError(f"tile mask {tuple(self.mask.shape)} does not match {self.q_end - self.q_start} "
                             f"queries x {self.slots.shape[0]} keys")


def pack_tiles(ext_lens: list[int], seq_lens: list[int], max_tile_elems: int = MAX_TILE_ELEMS) -> list[range]:
    """Group consecutive requests into tiles: returns the request index range of each tile, in order.

    A tile grows while ``sum(ext) * sum(seq)`` of its requests stays within ``max_tile_elems``; a request that
    exceeds it alone forms its own tile.

    Raises:
        ValueError: the lists differ in length, or a request has ``ext < 1`` or ``seq < ext``.
    """
    if len(ext_lens) != len(seq_lens):
        raise ValueError(f"{len(ext_lens)} extend lengths for {len(seq_lens)} sequences")
    tiles, start, q, k = [], 0, 0, 0
    for i, (ext, sl) in enumerate(zip(ext_lens, seq_lens, strict=True)):
        if ext < 1 or sl < ext:
            raise ValueError(f"request {i}: extend length {ext} must be in [1, seq_len {sl}]")
        if i > start and (q + ext) * (k + sl) > max_tile_elems:
            tiles.append(range(start, i))
            start, q, k = i, 0, 0
        q, k = q + ext, k + sl
    if ext_lens:
        tiles.append(range(start, len(ext_lens)))
    return tiles


def build_tiles(req_to_token: torch.Tensor, rows: list[int], ext_lens: list[int], prefix_lens: list[int],
                seq_lens: list[int], max_tile_elems: int = MAX_TILE_ELEMS) -> list[ExtendTile]:
    """The tiles of one extend step.

    Args:
        req_to_token: [rows, max_ctx] int64, the rank's request -> slot table.
        rows: each request's table row. ext_lens / prefix_lens / seq_lens: its new tokens, cached prefix and
            ``prefix + ext`` (tokens), host lists of equal length.
        max_tile_elems: see :func:`pack_tiles`.
    Returns:
        :class:`ExtendTile` list covering the step's tokens in order.
    Raises:
        ValueError: as :func:`pack_tiles`, or ``seq != prefix + ext`` for a request.
    """
    for i, (ext, pre, sl) in enumerate(zip(ext_lens, prefix_lens, seq_lens, strict=True)):
        if pre + ext != sl:
            raise ValueError(f"request {i}: prefix {pre} + extend {ext} != seq_len {sl}")
    dev = req_to_token.device
    tiles, q_start = [], 0
    for group in pack_tiles(ext_lens, seq_lens, max_tile_elems):
        ext = torch.tensor([ext_lens[i] for i in group], device=dev)
        sl = torch.tensor([seq_lens[i] for i in group], device=dev)
        n, tq, tk = len(group), sum(ext_lens[i] for i in group), sum(seq_lens[i] for i in group)
        seg = torch.arange(n, device=dev)
        k_seg = seg.repeat_interleave(sl, output_size=tk)                             # [S]
        k_pos = torch.arange(tk, device=dev) - (torch.cumsum(sl, 0) - sl)[k_seg]     # position in its sequence
        row = torch.tensor([rows[i] for i in group], device=dev)
        slots = req_to_token[row[k_seg], k_pos]
        mask = None
        if tq > 1 or n > 1:
            q_seg = seg.repeat_interleave(ext, output_size=tq)                        # [Tq]
            q_pos = (torch.arange(tq, device=dev) - (torch.cumsum(ext, 0) - ext)[q_seg]) + (sl - ext)[q_seg]
            mask = (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        tiles.append(ExtendTile(q_start, q_start + tq, slots, mask))
        q_start += tq
    return tiles
