"""Placement of rank actors: one placement group per TP group (STRICT_PACK: a TP group on one node).

Each DP group's ranks share a node (tensor-parallel collectives stay on the node's interconnect); different DP
groups go wherever a node has room, so with ``tp_size`` GPUs per node they land on different nodes. Bundles ask
for one GPU when ``use_gpu`` (the cluster declares GPUs), else a CPU share.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.cluster.topology import tp_group_ranks
from raymoe.config import ParallelConfig


@dataclass(frozen=True)
class RankPlacement:
    """Where rank ``rank`` runs: placement group ``pg`` and its bundle ``bundle_index``; ``resources`` it asks for."""

    rank: int
    pg: object
    bundle_index: int
    num_cpus: float
    num_gpus: float


def cluster_has_gpus(min_gpus: int = 1) -> bool:
    """Whether the connected Ray cluster declares at least ``min_gpus`` GPUs."""
    import ray

    return ray.cluster_resources().get("GPU", 0) >= min_gpus


def pg_owner_tag() -> str:
    """A tag naming the placement groups of the engine this process drives: the actor id inside an actor (so a
    restarted driver actor finds the groups its previous incarnation left behind), else a random one."""
    import uuid

    import ray

    actor_id = ray.get_runtime_context().get_actor_id()
    return actor_id[:16] if actor_id else uuid.uuid4().hex[:16]


def _remove_stale(names: list[str]) -> None:
    """Remove placement groups called ``names`` (left by a dead incarnation of the same driver actor: Ray keeps
    a restarted actor's groups, and its ranks died with it)."""
    import ray

    for name in names:
        try:
            pg = ray.util.get_placement_group(name)
        except ValueError:  # no such group
            continue
        ray.util.remove_placement_group(pg)


def place_ranks(cfg: ParallelConfig, use_gpu: bool | None = None, cpus_per_rank: float = 1.0,
                timeout_s: float = 120.0, owner: str | None = None) -> list[RankPlacement]:
    """Reserve bundles for every rank and wait until they are placed. The groups are named
    ``raymoe-tp{d}-{owner}``; groups of that name that already exist are removed first.

    Args:
        owner: tag of the engine (default :func:`pg_owner_tag`).

    Raises:
        TimeoutError: the cluster cannot fit the placement groups within ``timeout_s`` seconds.
    """
    import ray
    from ray.util.placement_group import placement_group

    if use_gpu is None:
        use_gpu = cluster_has_gpus(cfg.world_size)
    bundle = {"CPU": cpus_per_rank, "GPU": 1} if use_gpu else {"CPU": cpus_per_rank}
    groups = tp_group_ranks(cfg)
    owner = owner or pg_owner_tag()
    names = [f"raymoe-tp{d}-{owner}" for d in range(len(groups))]
    _remove_stale(names)
    pgs = [placement_group([dict(bundle) for _ in ranks], strategy="STRICT_PACK", name=name)
           for name, ranks in zip(names, groups, strict=True)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) != len(pgs):
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        raise TimeoutError(f"could not place {len(pgs)} TP groups of {bundle} x {cfg.tp_size} within {timeout_s} s")
    return [RankPlacement(rank, pgs[d], i, cpus_per_rank, 1.0 if use_gpu else 0.0)
            for d, ranks in enumerate(groups) for i, rank in enumerate(ranks)]


def release(placements: list[RankPlacement]) -> None:
    """Remove the placement groups of ``placements``."""
    import ray

    for pg in {id(p.pg): p.pg for p in placements}.values():
        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already gone (cluster shut down)
            pass
