"""Placement of rank actors: STRICT_PACK placement groups whose bundles the ranks are bound to in order.

GPU worlds follow the node-ordered plan (``raymoe.cluster.rank_plan``): one placement group per node of the plan,
its bundles (one GPU each) the node's ranks in local-rank order, so rank ``r`` runs on node ``r // G`` and DeepEP's
NVLink domains and every TP group stay inside a node. CPU worlds (no GPU bundles) take one placement group per TP
group: each DP group's ranks share a node (tensor-parallel collectives and the group scheduler's step channel stay
on it, ``raymoe.actors.group_hosts``) and the DP groups go wherever a node has room.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.cluster.rank_plan import RankPlan, check_placed, nvlink_domain, plan_gpu_ranks
from raymoe.cluster.topology import tp_group_ranks
from raymoe.config import ParallelConfig
from raymoe.errors import PlacementError


@dataclass(frozen=True)
class RankPlacement:
    """Where rank ``rank`` runs: placement group ``pg`` and its bundle ``bundle_index`` on node ``node_id``; the
    resources it asks for (``num_cpus``, ``num_gpus``)."""

    rank: int
    pg: object
    bundle_index: int
    num_cpus: float
    num_gpus: float
    node_id: str


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


def gpu_node_inventory() -> dict[str, float]:
    """The alive nodes of the connected Ray cluster that declare GPUs: node id -> GPU count."""
    import ray

    return {n["NodeID"]: n["Resources"]["GPU"] for n in ray.nodes()
            if n["Alive"] and n["Resources"].get("GPU", 0) > 0}


def _remove_stale(owner: str) -> None:
    """Remove the live placement groups of engine ``owner`` (``raymoe-...-{owner}``, left by a dead incarnation of
    the same driver actor: Ray keeps a restarted actor's groups, and its ranks died with it)."""
    import ray

    names = {info["name"] for info in ray.util.placement_group_table().values() if info["state"] != "REMOVED"
             and info["name"].startswith("raymoe-") and info["name"].endswith(f"-{owner}")}
    for name in names:
        try:
            pg = ray.util.get_placement_group(name)
        except ValueError:  # removed meanwhile
            continue
        ray.util.remove_placement_group(pg)


def place_ranks(cfg: ParallelConfig, use_gpu: bool | None = None, cpus_per_rank: float = 1.0,
                timeout_s: float = 120.0, owner: str | None = None, a2a_backend: str = "torch",
                plan: RankPlan | None = None) -> list[RankPlacement]:
    """Reserve bundles for every rank and wait until they are placed; returns one placement per rank, in rank order.

    GPU bundles follow ``plan`` (default: :func:`~raymoe.cluster.rank_plan.plan_gpu_ranks` of the cluster's GPU
    nodes, with DeepEP's NVLink domain for ``a2a_backend="deepep"``), in groups named ``raymoe-node{k}-{owner}``;
    CPU bundles form one group per TP group, ``raymoe-tp{d}-{owner}``. Live groups of ``owner`` are removed first.

    Args:
        cfg: the layout. use_gpu: one GPU per bundle (None: when the cluster declares a GPU per rank).
        cpus_per_rank: logical CPUs per bundle. timeout_s: how long to wait for the groups, seconds.
        owner: tag of the engine (default :func:`pg_owner_tag`). a2a_backend: the MoE all-to-all backend.
        plan: the GPU plan to follow (tests place a plan of chosen nodes).
    Raises:
        PlacementError: the GPU nodes do not admit a node-ordered plan (``plan_gpu_ranks``), or Ray placed the
            groups against it.
        TimeoutError: the cluster cannot fit the placement groups within ``timeout_s`` seconds.
    """
    import ray
    from ray.util.placement_group import placement_group

    if use_gpu is None:
        use_gpu = cluster_has_gpus(cfg.world_size)
    bundle = {"CPU": cpus_per_rank, "GPU": 1} if use_gpu else {"CPU": cpus_per_rank}
    owner = owner or pg_owner_tag()
    if use_gpu:
        plan = plan or plan_gpu_ranks(gpu_node_inventory(), cfg, nvlink_domain(a2a_backend, cfg.ep_size))
        groups, kind = [plan.node_ranks(k) for k in range(plan.num_nodes)], "node"
    else:
        groups, kind = tp_group_ranks(cfg), "tp"
    _remove_stale(owner)
    pgs = [placement_group([dict(bundle) for _ in ranks], strategy="STRICT_PACK", name=f"raymoe-{kind}{i}-{owner}")
           for i, ranks in enumerate(groups)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout_s)
    if len(ready) != len(pgs):
        _remove(pgs)
        raise TimeoutError(f"could not place {len(pgs)} {kind} groups of up to {len(groups[0])} x {bundle} within "
                           f"{timeout_s} s")
    placements = []
    for pg, ranks in zip(pgs, groups, strict=True):
        nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        placements += [RankPlacement(rank, pg, i, cpus_per_rank, 1.0 if use_gpu else 0.0, nodes[i])
                       for i, rank in enumerate(ranks)]
    if use_gpu:
        try:
            check_placed(plan, [p.node_id for p in placements])
        except PlacementError:
            _remove(pgs)
            raise
    return placements


def _remove(pgs: list) -> None:
    """Remove the placement groups ``pgs`` (placed or still pending)."""
    import ray

    for pg in pgs:
        ray.util.remove_placement_group(pg)


def release(placements: list[RankPlacement]) -> None:
    """Remove the placement groups of ``placements``."""
    import ray

    for pg in {id(p.pg): p.pg for p in placements}.values():
        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already gone (cluster shut down)
            pass
