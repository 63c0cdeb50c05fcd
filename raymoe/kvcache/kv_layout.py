"""A rank's KV pool as a transfer sees it: a list of buffers whose rows are KV slots.

Both pools have that shape: ``TokenToKVPool`` holds a key and a value buffer per layer, ``[num_slots + 1, Hkv, D]``,
and ``MLATokenToKVPool`` one latent buffer per layer, ``[num_slots + 1, kv_lora_rank + rope_dim]`` (DeepSeek's MLA
moves only its latent rows). Slot s of every buffer is row s, contiguous, so the KV of a set of slots is one
contiguous byte range per buffer and per run of consecutive slots; a transfer moves those ranges
(``raymoe.kvcache.kv_transfer``). Two ranks can exchange KV only when their buffers agree row for row (same layers,
heads on the rank, head size and dtype: the same TP size and dtype on both sides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class KVLayoutMismatch(ValueError):
    """Two ranks' KV pools cannot exchange rows (names what differs)."""


@dataclass(frozen=True)
class KVLayout:
    """The buffers of one rank's KV pool, each ``[num_slots + 1, ...]`` contiguous with slot s in row s.

    Attributes:
        buffers: the tensors (CPU or CUDA), in a fixed order (per layer: key then value, or the latent buffer).
        page_tokens: slots per KV page (``CacheConfig.page_tokens``): transfers move whole pages, one descriptor
            per page and buffer (the pool's slot count plus one is a whole number of pages).
        buffers_per_layer: consecutive buffers of one KV layer (2 for key/value pools, 1 for MLA's latent).
        num_slots: KV slots, not counting dummy slot 0.

    Raises:
        ValueError: no buffers, a buffer that is not contiguous, buffers of different row counts, or rows that are
            not a whole number of pages.
    """

    buffers: tuple[torch.Tensor, ...]
    page_tokens: int = 1
    buffers_per_layer: int = 1

    def __post_init__(self) -> None:
        if not self.buffers:
            raise ValueError("KVLayout needs at least one buffer")
        if self.page_tokens < 1 or self.buffers[0].shape[0] % self.page_tokens:
            raise ValueError(f"KVLayout: {self.buffers[0].shape[0]} rows are not whole pages of {self.page_tokens}")
        rows = {b.shape[0] for b in self.buffers}
        if len(rows) != 1:
            raise ValueError(f"KVLayout buffers have different slot counts: {sorted(rows)}")
        if not all(b.is_contiguous() for b in self.buffers):
            raise ValueError("KVLayout buffers must be contiguous")
        if self.buffers_per_layer < 1 or len(self.buffers) % self.buffers_per_layer:
            raise ValueError(f"KVLayout: {len(self.buffers)} buffers are not layers of {self.buffers_per_layer}")

    @classmethod
    def of_pool(cls, pool, page_tokens: int = 1) -> KVLayout:
        """The layout of a ``TokenToKVPool`` (key and value buffer per layer) or ``MLATokenToKVPool`` (latent)."""
        if hasattr(pool, "kv_buffer"):
            return cls(tuple(pool.kv_buffer), page_tokens)
        return cls(tuple(b for pair in zip(pool.k_buffer, pool.v_buffer, strict=True) for b in pair), page_tokens, 2)

    @property
    def num_layers(self) -> int:
        """KV layers of the pool (every layer that caches KV, the draft model's layers included)."""
        return len(self.buffers) // self.buffers_per_layer

    @property
    def num_slots(self) -> int:
        return self.buffers[0].shape[0] - 1

    @property
    def row_bytes(self) -> tuple[int, ...]:
        """Bytes of one slot's row in each buffer."""
        return tuple(b[0].numel() * b.element_size() for b in self.buffers)

    @property
    def device_type(self) -> str:
        return self.buffers[0].device.type

    def signature(self) -> dict:
        """What a peer must match: row bytes per buffer and the dtype (a plain dict, sent in metadata)."""
        return {"row_bytes": list(self.row_bytes), "dtype": str(self.buffers[0].dtype), "num_slots": self.num_slots,
                "page_tokens": self.page_tokens}

    def check_peer(self, peer: dict) -> None:
        """Raise unless a peer's ``signature()`` agrees row for row with this layout.

        Raises:
            KVLayoutMismatch: the buffer count, a row size or the dtype differs.
        """
        mine = self.signature()
        if peer.get("page_tokens", 1) != self.page_tokens:
            raise KVLayoutMismatch(f"KV pages differ: {self.page_tokens} tokens here, {peer.get('page_tokens')} on "
                                   "the peer (page_size must be the same on both sides)")
        if len(peer["row_bytes"]) != len(mine["row_bytes"]):
            raise KVLayoutMismatch(f"KV buffers differ in number: {len(mine['row_bytes'])} here, "
                                   f"{len(peer['row_bytes'])} on the peer (different models or layer counts)")
        if peer["row_bytes"] != mine["row_bytes"] or peer["dtype"] != mine["dtype"]:
            raise KVLayoutMismatch(f"KV rows differ: {mine['row_bytes'][0]} bytes of {mine['dtype']} here, "
                                   f"{peer['row_bytes'][0]} bytes of {peer['dtype']} on the peer (the prefill and "
                                   "decode ranks need the same TP size and KV dtype)")

    def gather(self, slots: Sequence[int]) -> torch.Tensor:
        """The rows of ``slots`` of every buffer as one flat uint8 tensor (buffer-major), on the buffers' device."""
        idx = torch.as_tensor(list(slots), dtype=torch.int64, device=self.buffers[0].device)
        return torch.cat([b.index_select(0, idx).reshape(-1).view(torch.uint8) for b in self.buffers])

    def scatter(self, slots: Sequence[int], flat: torch.Tensor) -> None:
        """Write ``flat`` (as :meth:`gather` of a layout with the same rows built it) into ``slots``.

        Raises:
            ValueError: ``flat`` has the wrong size.
        """
        n = len(slots)
        want = n * sum(self.row_bytes)
        if flat.numel() != want:
            raise ValueError(f"scatter: {flat.numel()} bytes for {n} slots, expected {want}")
        idx = torch.as_tensor(list(slots), dtype=torch.int64, device=self.buffers[0].device)
        offset = 0
        for b, rb in zip(self.buffers, self.row_bytes, strict=True):
            part = flat[offset:offset + n * rb].view(b.dtype).reshape(n, *b.shape[1:])
            b.index_copy_(0, idx, part.to(b.device))
            offset += n * rb

    def page_ranges(self) -> list[tuple[int, int]]:
        """One ``(address, bytes)`` per (buffer, page), buffer-major: entry ``k * pages + p`` is page p of buffer k
        (the descriptor list a transfer library registers once and indexes per transfer)."""
        out = []
        p = self.page_tokens
        for b, rb in zip(self.buffers, self.row_bytes, strict=True):
            base = b.data_ptr()
            out.extend((base + i * p * rb, p * rb) for i in range(b.shape[0] // p))
        return out

    def page_indices(self, slots: Sequence[int], num_slots: int | None = None) -> list[int]:
        """The :meth:`page_ranges` entries holding ``slots`` in every buffer, buffer-major, for a pool of
        ``num_slots`` slots (default: this one's; a peer's when indexing its list).

        ``slots`` are a prompt's slots as a paged allocator lays them out (``raymoe.kvcache.paged_allocator``):
        whole pages in position order, the last one possibly partial (the first ``len(slots) % page_tokens`` slots
        of its page). That page moves whole: the rows past the prompt are the rest of the same page, which the
        allocator hands to no one else (on the receiving side, the reservation's own unused slots), and no kernel
        reads them (they lie past the sequence).

        Raises:
            ValueError: ``slots`` are not laid out so (whole pages in order, then at most one partial page).
        """
        p = self.page_tokens
        runs = [list(slots[j:j + p]) for j in range(0, len(slots), p)]  # one per page; the last may be shorter
        starts = [run[0] // p for run in runs]
        if p > 1 and any(run != list(range(s * p, s * p + len(run))) for run, s in zip(runs, starts, strict=True)):
            raise ValueError(f"KV transfer slots must be pages of {p} in order (the last one may be partial)")
        return self._descriptors(starts, num_slots, range(len(self.buffers)))

    def pages_touched(self, slots: Sequence[int]) -> list[int]:
        """The pages holding ``slots``, in the order the slots first reach them (consecutive slots of one page
        give it once): a run of prompt positions laid out by page (position j at offset ``j % page_tokens``)
        touches the same number of pages on any two pools."""
        p = self.page_tokens
        pages: list[int] = []
        for s in slots:
            if not pages or s // p != pages[-1]:
                pages.append(s // p)
        return pages

    def layer_indices(self, pages: Sequence[int], layers: Sequence[int], num_slots: int | None = None) -> list[int]:
        """The :meth:`page_ranges` entries of ``pages`` in the buffers of KV ``layers`` (a pool of ``num_slots``
        slots: a peer's, when indexing its list).

        Raises:
            ValueError: a layer outside the pool.
        """
        if any(not 0 <= layer < self.num_layers for layer in layers):
            raise ValueError(f"KV layers {list(layers)} outside this pool's {self.num_layers}")
        per = self.buffers_per_layer
        return self._descriptors(pages, num_slots, [layer * per + j for layer in layers for j in range(per)])

    def _descriptors(self, pages: Sequence[int], num_slots: int | None, buffers: Sequence[int]) -> list[int]:
        count = ((self.num_slots if num_slots is None else num_slots) + 1) // self.page_tokens
        return [k * count + s for k in buffers for s in pages]
