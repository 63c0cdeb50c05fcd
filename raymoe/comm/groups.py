"""Explicit process-group handles of one rank.

Layers receive a :class:`ParallelGroups` and use ``tp_group`` / ``ep_group`` explicitly; nothing here or below
falls back to the world group. A single-process engine uses :meth:`ParallelGroups.single` (all sizes 1, no
groups), in which case every collective is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from raymoe.comm.transport import EpTransport


@dataclass(frozen=True)
class ParallelGroups:
    """Coordinates and process groups of one rank.

    Attributes:
        world_rank, world_size: position in the whole engine (``world = dp_size * tp_size``).
        tp_rank, tp_size, tp_group: tensor-parallel group of attention/dense layers (ranks of one DP group).
        dp_rank, dp_size: data-parallel attention group index and count.
        ep_rank, ep_size, ep_group: expert-parallel group (``ep_size == world_size`` or 1).
        ep_transport: the EP group's transport as the rank's platform made it (the CPU platform's shared-memory
            exchange when the group's ranks share a node and ``cpu_comm`` allows it); None: every MoE exchange
            runs as ``torch.distributed`` collectives over ``ep_group``
            (``raymoe.comm.ep_transport.ep_transport_of``).
    """

    world_rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None
    ep_transport: EpTransport | None = None

    def __post_init__(self) -> None:
        if self.world_size != self.tp_size * self.dp_size:
            raise ValueError(f"world_size {self.world_size} != tp_size {self.tp_size} * dp_size {self.dp_size}")
        if self.ep_size not in (1, self.world_size):
            raise ValueError("ep_size must be 1 or the world size")
        if self.tp_size > 1 and self.tp_group is None:
            raise ValueError("tp_size > 1 needs a tp_group handle")
        if self.ep_size > 1 and self.ep_group is None:
            raise ValueError("ep_size > 1 needs an ep_group handle")

    @classmethod
    def single(cls) -> "ParallelGroups":
        """The one-rank layout: no collectives at all."""
        return cls()


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact division for shard sizes.

    Raises:
        ValueError: when ``numerator`` is not a multiple of ``denominator``.
    """
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group in place (no-op when ``tp_size == 1``)."""
    if groups.tp_size > 1:
        dist.all_reduce(x, group=groups.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Concatenate ``x`` [..., n] from all tp ranks along the last dim -> [..., n * tp_size]."""
    if groups.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(groups.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=groups.tp_group)
    return torch.cat(parts, dim=-1)
