"""Rank -> (dp, tp, ep) coordinates and creation of the explicit process groups.

Rank layout: rank ``r`` is tp-rank ``r % tp_size`` of DP group ``r // tp_size`` (a TP group is a contiguous
block of ranks, which placement keeps on one node). The EP group is every rank when ``ep_size == world_size``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from raymoe.cluster.rendezvous import rendezvous_store
from raymoe.comm.groups import ParallelGroups
from raymoe.config import CPU_COMM_MODES, ParallelConfig
from raymoe.platform.interface import Platform


@dataclass(frozen=True)
class RankCoords:
    """Position of one rank: ``rank`` in the world, ``dp_rank`` (its DP group), ``tp_rank`` within it."""

    rank: int
    dp_rank: int
    tp_rank: int


def rank_coords(rank: int, cfg: ParallelConfig) -> RankCoords:
    """Coordinates of ``rank``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
    """
    if not 0 <= rank < cfg.world_size:
        raise ValueError(f"rank {rank} outside world of {cfg.world_size}")
    return RankCoords(rank, rank // cfg.tp_size, rank % cfg.tp_size)


def tp_group_ranks(cfg: ParallelConfig) -> list[list[int]]:
    """World ranks of every TP group, in DP-group order."""
    return [list(range(d * cfg.tp_size, (d + 1) * cfg.tp_size)) for d in range(cfg.dp_size)]


def init_parallel_groups(rank: int, cfg: ParallelConfig, init_method: str, backend: str = "gloo",
                         timeout_s: float = 60.0, device_id=None, cpu_comm: str = "auto",
                         platform: Platform | None = None, listen_sock=None) -> ParallelGroups:
    """Join the world process group and create the TP and EP groups (every rank must call this).

    Args:
        rank: this rank. cfg: layout. init_method: rendezvous URL ``tcp://host:port`` (rank 0 serves the store on
            that address only, ``raymoe.cluster.rendezvous``).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU). timeout_s: collective and rendezvous timeout, seconds.
        device_id: the rank's CUDA ``torch.device`` for NCCL (binds the communicator to it eagerly); None on CPU.
        cpu_comm: the EP all-to-all of CPU ranks (``MoeCommConfig.cpu_comm``): ``"auto"`` (shared memory when
            every EP rank is on this node and the machine supports it, else gloo), ``"shm"`` (shared memory or an
            error) or ``"gloo"``.
        platform: the rank's platform, which makes the EP group's transport
            (:meth:`~raymoe.platform.interface.Platform.create_ep_transport`); None: ``torch.distributed`` only.
        listen_sock: rank 0's pre-bound rendezvous socket (``raymoe.cluster.rendezvous.rendezvous_store``).
    Returns:
        the rank's ``ParallelGroups`` with explicit group handles.
    Raises:
        RuntimeError / DistBackendError: rendezvous failed or timed out.
        ValueError: ``init_method`` is not ``tcp://host:port``.
        ValueError: an unknown ``cpu_comm``; ``"shm"`` but the EP ranks span nodes or the machine has no usable
            ``/dev/shm``.
        OSError: ``cpu_comm="shm"`` and ``/dev/shm`` cannot hold the mapping.
    """
    if cpu_comm not in CPU_COMM_MODES:
        raise ValueError(f"cpu_comm must be one of {CPU_COMM_MODES}, got {cpu_comm!r}")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # rank 0 listens on its address only
        store = rendezvous_store(init_method, rank, cfg.world_size, timeout, listen_sock=listen_sock)
        dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.world_size, timeout=timeout,
                                **({"device_id": device_id} if device_id is not None else {}))
    coords = rank_coords(rank, cfg)
    tp_group = None
    for ranks in tp_group_ranks(cfg):
        # new_group is collective: every rank creates every group, in the same order.
        g = dist.new_group(ranks, timeout=timeout) if cfg.tp_size > 1 else None
        if rank in ranks:
            tp_group = g
    ep_group = dist.new_group(list(range(cfg.world_size)), timeout=timeout) if cfg.ep_size > 1 else None
    groups = ParallelGroups(
        world_rank=rank, world_size=cfg.world_size, tp_rank=coords.tp_rank, tp_size=cfg.tp_size, tp_group=tp_group,
        dp_rank=coords.dp_rank, dp_size=cfg.dp_size, ep_rank=rank if cfg.ep_size > 1 else 0, ep_size=cfg.ep_size,
        ep_group=ep_group,
    )
    if platform is None:
        return groups
    return dataclasses.replace(groups, ep_transport=platform.create_ep_transport(groups, cpu_comm, timeout_s))
