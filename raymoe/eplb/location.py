"""ExpertLocation: where every logical expert of every MoE layer lives among the EP group's physical slots.

With ``ep_num_redundant_experts = N`` the EP group holds ``P = E + N`` physical expert slots, ``P / ep_size`` per
rank (rank ``r`` holds slots ``[r * P / ep, (r + 1) * P / ep)``); each slot holds one logical expert and every
logical expert has at least one slot (hot experts several: replicas). The map is per MoE layer (ordinal: 0 is the
model's first MoE layer). Plain data: the driver decides it (trivially, from a file written by ``raymoe eplb dump``
via ``init_expert_location``, or by a rebalance) and ranks build their weights and routing tables from it.

The file format (JSON): ``{"num_logical_experts": E, "physical_to_logical": [[...P ids...] per MoE layer]}``, or
a load record ``{"num_logical_experts": E, "expert_load": [[...E counts...] per layer], ...}`` (what ``raymoe eplb
dump`` writes), from which a placement is computed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ExpertLocation:
    """Physical slot -> logical expert, per MoE layer.

    Attributes:
        num_logical: logical experts E. physical_to_logical: one tuple of ``P`` logical ids per MoE layer.
    Raises:
        ValueError: no layers, layers of different widths, ``P < E``, an id out of ``[0, E)`` or a logical expert
            without a slot in some layer (the field is named).
    """

    num_logical: int
    physical_to_logical: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.num_logical < 1 or not self.physical_to_logical:
            raise ValueError("ExpertLocation needs num_logical >= 1 and at least one MoE layer")
        p = len(self.physical_to_logical[0])
        if p < self.num_logical:
            raise ValueError(f"ExpertLocation.physical_to_logical: {p} slots for {self.num_logical} experts")
        for i, row in enumerate(self.physical_to_logical):
            if len(row) != p:
                raise ValueError(f"ExpertLocation.physical_to_logical[{i}] has {len(row)} slots, expected {p}")
            if min(row) < 0 or max(row) >= self.num_logical:
                raise ValueError(f"ExpertLocation.physical_to_logical[{i}] holds an id outside [0, "
                                 f"{self.num_logical})")
            if len(set(row)) != self.num_logical:
                raise ValueError(f"ExpertLocation.physical_to_logical[{i}]: a logical expert has no slot")

    @property
    def num_layers(self) -> int:
        """MoE layers."""
        return len(self.physical_to_logical)

    @property
    def num_physical(self) -> int:
        """Physical slots P of each layer."""
        return len(self.physical_to_logical[0])

    @property
    def max_replicas(self) -> int:
        """The most slots one logical expert can have: ``P - E + 1`` (the width of the ranks' routing tables,
        fixed so a new placement never changes a captured graph's shapes)."""
        return self.num_physical - self.num_logical + 1

    @classmethod
    def trivial(cls, num_layers: int, num_logical: int, num_physical: int) -> ExpertLocation:
        """Slot ``p`` holds expert ``p % E`` in every layer (redundant slots replicate experts 0, 1, ...)."""
        row = tuple(p % num_logical for p in range(num_physical))
        return cls(num_logical, (row,) * num_layers)

    def with_layer(self, layer: int, row: tuple[int, ...]) -> ExpertLocation:
        """A copy with MoE layer ``layer``'s map replaced by ``row``."""
        rows = list(self.physical_to_logical)
        rows[layer] = tuple(row)
        return ExpertLocation(self.num_logical, tuple(rows))

    def replicas(self, layer: int) -> list[list[int]]:
        """Per logical expert, its physical slots in ``layer``, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, e in enumerate(self.physical_to_logical[layer]):
            out[e].append(slot)
        return out

    def routing_table(self, layer: int) -> tuple[list[list[int]], list[int]]:
        """The ranks' routing table of ``layer``: ``[E][max_replicas]`` physical slots (unused entries repeat
        the first) and ``[E]`` replica counts."""
        table, counts = [], []
        for slots in self.replicas(layer):
            counts.append(len(slots))
            table.append(slots + [slots[0]] * (self.max_replicas - len(slots)))
        return table, counts

    def to_json(self) -> dict:
        return {"num_logical_experts": self.num_logical,
                "physical_to_logical": [list(r) for r in self.physical_to_logical]}

    @classmethod
    def from_json(cls, data: dict) -> ExpertLocation:
        """From :meth:`to_json`'s form.

        Raises:
            ValueError: a missing key or an invalid map.
        """
        try:
            return cls(int(data["num_logical_experts"]), tuple(tuple(int(x) for x in r)
                                                               for r in data["physical_to_logical"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not an expert location: {e!r}") from e


def read_location_file(path: str | Path) -> dict:
    """The JSON object of an ``init_expert_location`` file.

    Raises:
        ValueError: the file cannot be read or is not a JSON object (the path is named).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"init_expert_location {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"init_expert_location {path}: not a JSON object")
    return data
