"""ExpertUpdate: the driver's expert-parallel load-balancing work for one step, shipped inside the step's
``StepDecision`` to every rank (``raymoe.eplb``).

Every EP rank applies the same record at the start of the same step, in this order: wait for the weight transfers
it posted at the previous update; switch ``commit`` (one MoE layer: the staged weights become live and the layer's
logical -> physical map changes); post this step's ``transfers`` (its own sends and receives, into staging
buffers, on a process group of their own so the step's collectives never wait for them). ``report_load`` asks
each DP group's answering rank to attach its cumulative expert-load counters to its ``StepOutput``.

Plain frozen data: the driver builds it (``raymoe.eplb.controller``), the ranks apply it
(``raymoe.eplb.weight_mover``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertTransfer:
    """One expert's weights moving into one physical slot of one MoE layer.

    Attributes:
        layer: MoE layer ordinal (0 = the model's first MoE layer). src_slot: a global physical slot that holds
            the expert now (its rank, ``src_slot // slots_per_rank``, sends). dst_slot: the global physical slot
            that holds it after the layer's commit (its rank receives; the same rank copies locally).
        piece, num_pieces: this transfer moves piece ``piece`` of ``num_pieces`` equal byte ranges of each of the
            slot's tensors (pieces of one copy go in order, possibly over several steps).
    Raises:
        ValueError: a negative index, or a piece outside ``[0, num_pieces)``.
    """

    layer: int
    src_slot: int
    dst_slot: int
    piece: int = 0
    num_pieces: int = 1

    def __post_init__(self) -> None:
        if min(self.layer, self.src_slot, self.dst_slot) < 0 or not 0 <= self.piece < self.num_pieces:
            raise ValueError(f"ExpertTransfer fields must be >= 0 with piece < num_pieces, got {self}")


@dataclass(frozen=True)
class LayerCommit:
    """The switch of one MoE layer to its new placement at the start of a step.

    Attributes:
        layer: MoE layer ordinal. physical_to_logical: the layer's new map, one logical expert id per global
            physical slot (``P`` entries).
    Raises:
        ValueError: an empty map or a negative id.
    """

    layer: int
    physical_to_logical: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.layer < 0 or not self.physical_to_logical or min(self.physical_to_logical) < 0:
            raise ValueError("LayerCommit needs a layer >= 0 and a non-empty map of logical ids >= 0")


@dataclass(frozen=True)
class ExpertUpdate:
    """The step's load-balancing work (module docstring).

    Attributes:
        transfers: weight moves every rank posts this step (each rank takes those it sends or receives).
        commit: the layer switched at the start of this step (its transfers were all posted at earlier steps), or
            None. report_load: the answering rank of each DP group attaches its cumulative load counters.
    """

    transfers: tuple[ExpertTransfer, ...] = ()
    commit: LayerCommit | None = None
    report_load: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to do on any rank."""
        return not self.transfers and self.commit is None and not self.report_load
