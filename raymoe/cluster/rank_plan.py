"""The placement plan of a GPU world: the node and the node-local GPU of every rank (pure: no Ray).

The rule, SGLang's and the one DeepEP assumes: with ``G`` GPUs on every node, global rank ``r`` (its EP rank too)
runs on node ``r // G`` as local rank ``r % G``. TP groups are contiguous blocks of ranks
(``raymoe.cluster.topology``), so with ``tp_size`` dividing ``G`` each TP group stays inside one node; DP groups
fill the nodes in order (DP group ``d`` on node ``d * tp_size // G``), and a world larger than a node spreads over
``ceil(world / G)`` nodes. DeepEP (v1.2.1, ``deep_ep.cpp`` ``Buffer::Buffer`` and ``sync``) takes rank ``r`` to be
GPU ``r % 8`` of node ``r // 8`` (``NUM_MAX_NVL_PEERS`` = 8): it opens the CUDA IPC handles of ranks
``[8 (r // 8), 8 (r // 8) + 8)`` as its NVLink peers and reaches the ranks with its GPU index on other nodes over
RDMA, so those ranks must share a node (:func:`nvlink_domain`).

``raymoe.cluster.placement`` makes one STRICT_PACK placement group per node of the plan, the node's ranks as its
bundles in local-rank order. Ray picks the node of each group; a group of ``G`` one-GPU bundles fills a node, so
the groups land on distinct nodes (checked after placement, :func:`check_placed`).

The CUDA device of a rank (:func:`rank_cuda_devices`): Ray hands each rank actor the GPU of its bundle
(``ray.get_gpu_ids()``) and sets ``CUDA_VISIBLE_DEVICES`` to it alone. CUDA IPC between the ranks of a node (DeepEP's
NVLink buffers) needs the peers' GPUs visible, so a rank sees all the GPUs its node's ranks hold, listed in rank
order, and takes device ``local_rank`` of them (``raymoe.actors.rank_devices`` sets both in the rank's process):
rank ``r`` then computes on ``cuda:(r % G)``, the GPU Ray reserved for it, as an SGLang rank takes
``gpu_id = tp_rank % gpus_per_node`` (vLLM's Ray executor likewise makes a node's worker GPUs visible to each).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from raymoe.config import ParallelConfig
from raymoe.errors import PlacementError

#: DeepEP's NVLink domain: ranks [8 n, 8 n + 8) are taken as the GPUs of one node (``NUM_MAX_NVL_PEERS``,
#: ``csrc/kernels/configs.cuh``).
DEEPEP_NVL_PEERS = 8


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs: ``node`` (index of the plan's node, 0 first) and ``local_rank`` (its position there:
    its bundle index in the node's placement group, and its CUDA device among the GPUs its node's ranks hold)."""

    rank: int
    node: int
    local_rank: int


@dataclass(frozen=True)
class RankPlan:
    """The node-ordered plan of a GPU world (:func:`plan_gpu_ranks`).

    Attributes:
        gpus_per_node: G, the GPUs every node of the cluster declares. slots: one per rank, in rank order.

    Raises:
        ValueError: slots not in rank order, or not ``(r // G, r % G)``.
    """

    gpus_per_node: int
    slots: tuple[RankSlot, ...]

    def __post_init__(self) -> None:
        g = self.gpus_per_node
        if g < 1 or any(s != RankSlot(r, r // g, r % g) for r, s in enumerate(self.slots)):
            raise ValueError(f"a plan puts rank r on node r // {g} as local rank r % {g}, in rank order")

    @property
    def num_nodes(self) -> int:
        """Nodes the world takes: ``ceil(world / G)`` (the last one partly filled when G does not divide it)."""
        return -(-len(self.slots) // self.gpus_per_node)

    def node_ranks(self, node: int) -> list[int]:
        """The ranks on plan node ``node``, in local-rank order."""
        return [s.rank for s in self.slots if s.node == node]


def nvlink_domain(a2a_backend: str, ep_size: int) -> int:
    """How many consecutive ranks the MoE all-to-all needs on one node: DeepEP's NVLink domain (at most 8 ranks,
    all EP ranks below that) for ``a2a_backend="deepep"``, else 1 (NCCL finds its peers wherever they are)."""
    return min(ep_size, DEEPEP_NVL_PEERS) if a2a_backend == "deepep" and ep_size > 1 else 1


def plan_gpu_ranks(node_gpus: Mapping[str, float], cfg: ParallelConfig, nvlink_ranks: int = 1) -> RankPlan:
    """The node-ordered plan of ``cfg``'s world on a cluster whose GPU nodes are ``node_gpus``.

    Args:
        node_gpus: node id -> GPUs it declares, for the nodes that declare any (order does not matter).
        cfg: the parallel layout (world = dp_size * tp_size ranks, one GPU each).
        nvlink_ranks: blocks of this many consecutive ranks must share a node (:func:`nvlink_domain`).
    Raises:
        PlacementError: no node declares a GPU; the nodes declare different or fractional GPU counts; ``tp_size``
            does not divide the GPUs of a node (a TP group would span nodes); a block of ``nvlink_ranks`` ranks
            would span nodes.
    """
    if not node_gpus:
        raise PlacementError("no node of the cluster declares a GPU; GPU ranks need GPU nodes")
    counts = sorted({float(n) for n in node_gpus.values()})
    if len(counts) > 1 or not counts[0].is_integer() or counts[0] < 1:
        by_count = {c: [i[:8] for i, n in node_gpus.items() if float(n) == c] for c in counts}
        raise PlacementError(f"node-ordered ranks (rank r on node r // G) need nodes that declare the same whole "
                             f"number of GPUs G; the GPU nodes declare {by_count} (GPUs: node ids)")
    g = int(counts[0])
    if g % cfg.tp_size:
        raise PlacementError(f"tp_size {cfg.tp_size} does not divide the {g} GPUs of a node: a TP group would span "
                             "two nodes")
    plan = RankPlan(g, tuple(RankSlot(r, r // g, r % g) for r in range(cfg.world_size)))
    for first in range(0, cfg.world_size, nvlink_ranks):
        block = plan.slots[first:first + nvlink_ranks]
        nodes = len({s.node for s in block})
        if nodes > 1:
            raise PlacementError(
                f"a2a_backend deepep takes ranks {first}-{block[-1].rank} as the GPUs of one node (its NVLink peers, "
                f"NUM_MAX_NVL_PEERS = {DEEPEP_NVL_PEERS}), but nodes of {g} GPUs put them on {nodes} nodes; use "
                "nodes of 8 GPUs (or a multiple of 8), or ep_size <= the GPUs of a node")
    return plan


def check_placed(plan: RankPlan, node_ids: Sequence[str]) -> None:
    """That the placed ranks follow ``plan``: ``node_ids[r]`` is the node rank ``r`` was placed on; the ranks of a
    plan node share one node and the plan's nodes are distinct ones.

    Raises:
        PlacementError: the placement does not follow the plan.
    """
    if len(node_ids) != len(plan.slots):
        raise PlacementError(f"{len(node_ids)} placed ranks for a plan of {len(plan.slots)}")
    where = [{node_ids[r] for r in plan.node_ranks(k)} for k in range(plan.num_nodes)]
    if any(len(w) != 1 for w in where) or len(set.union(*where)) != plan.num_nodes:
        raise PlacementError(f"the ranks were not placed node by node as planned (ranks of plan node k -> "
                             f"nodes: {[sorted(n[:8] for n in w) for w in where]})")


@dataclass(frozen=True)
class RankDevice:
    """The CUDA device of one rank: ``visible_devices`` (the ``CUDA_VISIBLE_DEVICES`` value: the GPU ids the ranks of
    its node hold, in local-rank order) and ``device_index`` (its own GPU among them: its local rank)."""

    visible_devices: str
    device_index: int


def rank_cuda_devices(nodes: Sequence[Hashable], gpu_ids: Sequence[Sequence[int | str]]) -> list[RankDevice]:
    """The CUDA device of every rank from the node it runs on and the GPU ids Ray gave it.

    Args:
        nodes: ``nodes[r]``, the node of rank ``r`` (a plan's ``slot.node`` or a placed node id; any hashable).
        gpu_ids: ``gpu_ids[r]``, rank ``r``'s ``ray.get_gpu_ids()`` (ints, or strings when the node's own
            ``CUDA_VISIBLE_DEVICES`` named them).
    Returns:
        one :class:`RankDevice` per rank: the GPUs of its node's ranks in rank order, and its position there
        (``r % G`` under a node-ordered plan).
    Raises:
        PlacementError: the lists differ in length, a rank holds other than one GPU, or two ranks of one node hold
            the same GPU.
    """
    if len(gpu_ids) != len(nodes):
        raise PlacementError(f"GPU ids of {len(gpu_ids)} ranks for {len(nodes)} placed ranks")
    for r, ids in enumerate(gpu_ids):
        if len(ids) != 1:
            raise PlacementError(f"rank {r} holds GPUs {list(ids)}; each rank computes on exactly one")
    members: dict[Hashable, list[int]] = {}
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)
    devices: list[RankDevice | None] = [None] * len(nodes)
    for ranks in members.values():
        ids = [str(gpu_ids[r][0]) for r in ranks]
        if len(set(ids)) != len(ids):
            raise PlacementError(f"ranks {ranks} of one node hold GPUs {ids}: one GPU each")
        for i, r in enumerate(ranks):
            devices[r] = RankDevice(",".join(ids), i)
    return devices
