"""Layer-by-layer KV streaming records (prefill/decode disaggregation, ``raymoe.client.pd_client``): what a
prefill request carries so the prefill ranks write its prompt's KV into the decode engine's reserved slots while
they compute, and what one step hands each rank to write.

Ownership: :class:`KVStreamTarget` rides with a prefill request from the PD client (``AddRequest.kv_stream``) to
its ``Req``; the scheduler cuts one :class:`KVStreamChunk` per step that computes some of the prompt
(``ModelWorkerBatch.kv_streams``); the rank's ``raymoe.kvcache.kv_stream.KVLayerStream`` writes each chunk's rows
layer by layer as the forward passes each layer, and after the step's last layer waits for its writes and, on a
request's last chunk, notifies the decode rank (the notification is what the decode side's ``receive_kv`` waits
for). Plain numbers and strings only: the records cross Ray actor boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

FAILED_SUFFIX = "!failed"
"""Appended to a request's tag in the notification a prefill rank sends when it could not write the request's
rows (the decode side then stops waiting and re-prefills instead)."""


@dataclass(frozen=True)
class KVStreamTarget:
    """Where a prefill request's prompt KV goes.

    Attributes:
        tag: the transfer's name (the request id), carried by the final notification.
        peers: the decode group's KV agent names, one per TP rank (prefill TP rank i writes to ``peers[i]``).
        dst_slots: the decode group's reserved slots, one per prompt position (``Driver.reserve_kv``).
        timeout_s: bound on one step's writes, seconds.

    Raises:
        ValueError: no peers, no slots, a slot below 1 (slot 0 is the dummy slot) or a bound that is not positive.
    """

    tag: str
    peers: tuple[str, ...]
    dst_slots: tuple[int, ...]
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.peers or not self.dst_slots:
            raise ValueError("KVStreamTarget needs at least one peer and one destination slot")
        if min(self.dst_slots) < 1:
            raise ValueError("KVStreamTarget.dst_slots must be real KV slots (>= 1)")
        if not self.timeout_s > 0:
            raise ValueError(f"KVStreamTarget.timeout_s must be positive, got {self.timeout_s}")

    def chunk(self, src_slots: list[int], start: int, end: int) -> KVStreamChunk:
        """The chunk of prompt positions ``[start, end)`` whose KV sits in ``src_slots`` (one per position)."""
        return KVStreamChunk(self.tag, self.peers, tuple(src_slots), self.dst_slots[start:end],
                             last=end == len(self.dst_slots), timeout_s=self.timeout_s)


@dataclass(frozen=True)
class KVStreamChunk:
    """One step's rows of one streamed request, for every rank of the prefill group.

    Attributes:
        tag, peers, timeout_s: as :class:`KVStreamTarget`.
        src_slots, dst_slots: the prefill rank's slots and the decode rank's slots of the same prompt positions
            (a run of consecutive positions, laid out by page on both sides: position j at offset ``j % page``).
            Positions of a page another step wrote as well move again with the whole page.
        last: the request's last chunk: after its rows land, the decode rank is notified.

    Raises:
        ValueError: the slot lists differ in length or are empty.
    """

    tag: str
    peers: tuple[str, ...]
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    last: bool
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.src_slots or len(self.src_slots) != len(self.dst_slots):
            raise ValueError(f"KVStreamChunk {self.tag!r}: {len(self.src_slots)} source slots for "
                             f"{len(self.dst_slots)} destination slots")
