"""The list algorithms behind :mod:`raymoe.eplb.placement`: EPLB's packing and replication, and our refinement.

``balanced_packing`` and ``replica_counts`` are the two greedy steps of DeepSeek's expert-parallel load balancer
(github.com/deepseek-ai/EPLB, ``eplb.py``: ``balanced_packing``, ``replicate_experts``; DeepSeek-V3 report,
arXiv:2412.19437, section 3.4), written anew over Python lists with every tie broken by the lowest index.

``refine_node`` goes beyond the published policy. EPLB chooses the replica counts to minimise the largest load per
replica, then packs; but a rank holds a fixed number of slots, and when more heavy replicas exist than ranks two of
them share one (four experts, eight slots, four ranks, loads 1000/125/37/16: EPLB's counts 5/1/1/1 put two
replicas of 200 on one rank, 400, where counts 4/2/1/1 give 312.5). Against a brute-force optimum on 720 seeded
Zipf-like loads (2-6 experts, up to 12 slots, 2-4 ranks), EPLB alone put the heaviest rank up to 31 % above the
optimum (137 cases beyond 5 %), with the refinement at most 1.7 % (``tests/test_eplb_placement.py`` checks a
smaller grid against the 5 % bound). The refinement keeps only changes that lower a node's heaviest rank, so it is
never worse than EPLB, and its work per call is bounded (:data:`REFINE_WORK`) so large models stay cheap: a node of
288 slots in a 58-layer call is left as EPLB packs it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import NamedTuple

#: Refinement stops once a node's heaviest rank is within this fraction of the layer's lower bound.
REFINE_TOLERANCE = 0.01
#: Work one placement call's refinement may spend, shared evenly by its layers, counted as replicas packed plus
#: swap pairs examined (about 0.6 us each on a shared 2-core CPU, so at most ~30 ms a call): a layer of one small
#: node gets up to about a thousand trials, a layer of hundreds of slots per node (58 layers of 288) one or two.
REFINE_WORK = 48 * 1024
#: A node is refined only when the work left covers this many packings of it (fewer trials rarely find a gain).
MIN_TRIALS = 4
#: Swaps one packing may make, and the lightest packs the heaviest one tries to swap with.
MAX_SWAPS = 32
SWAP_PARTNERS = 2


def balanced_packing(loads: list[float], num_packs: int) -> list[list[int]]:
    """Greedy packing of ``len(loads)`` items into ``num_packs`` packs of equal item count: items heaviest first
    (ties: lowest index) each go to the lightest pack that still has room (ties: lowest pack).

    Args:
        loads: one load per item; ``len(loads)`` is a multiple of ``num_packs``.
        num_packs: >= 1.

    Returns: per pack, the item indices in the order they were packed.
    """
    per_pack = len(loads) // num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    open_packs = [(0.0, k) for k in range(num_packs)]  # (load so far, pack): a min-heap of the packs with room
    for item in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        load, k = heapq.heappop(open_packs)
        packs[k].append(item)
        if len(packs[k]) < per_pack:
            heapq.heappush(open_packs, (load + loads[item], k))
    return packs


def replica_counts(loads: list[float], num_slots: int, min_replicas: int = 1) -> list[int]:
    """Replicas per expert for ``num_slots >= min_replicas * len(loads)`` slots: ``min_replicas`` each, then each
    further slot to the expert with the highest load per replica (ties: fewer replicas, then lowest index, so
    experts without load share the spare slots instead of stacking them on the first). This minimises the largest
    load per replica among counts of at least ``min_replicas``."""
    counts = [min_replicas] * len(loads)
    heap = [(-load / min_replicas, min_replicas, e) for e, load in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(num_slots - min_replicas * len(loads)):
        _, _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-loads[e] / counts[e], counts[e], e))
    return counts


class NodePacking(NamedTuple):
    """One node's replicas on its ranks: ``ranks[r]`` lists the local expert of each slot of rank r (in packing
    order), ``peak`` is the heaviest rank's load (tokens), ``work`` what building it cost (:data:`REFINE_WORK`)."""

    peak: float
    ranks: list[list[int]]
    work: int


def pack_node(node_loads: list[float], counts: list[int], num_ranks: int, swap: bool) -> NodePacking:
    """EPLB's step 3 for one node: ``counts[j]`` replicas of local expert j, each carrying ``node_loads[j] /
    counts[j]``, packed to ``num_ranks`` ranks of equal slot count; with ``swap``, then improved by swapping
    replicas out of the heaviest rank (:func:`_swap_from_heaviest`)."""
    replicas = [j for j, c in enumerate(counts) for _ in range(c)]
    replica_loads = [node_loads[j] / counts[j] for j in replicas]
    packs = balanced_packing(replica_loads, num_ranks)
    sums = [sum(replica_loads[i] for i in pack) for pack in packs]
    work = len(replicas) + (_swap_from_heaviest(replica_loads, packs, sums) if swap else 0)
    return NodePacking(max(sums), [[replicas[i] for i in pack] for pack in packs], work)


def _swap_from_heaviest(loads: list[float], packs: list[list[int]], sums: list[float]) -> int:
    """Improve a packing in place (``sums``: each pack's load, kept up to date): swap an item of the heaviest pack
    with a lighter item of one of the :data:`SWAP_PARTNERS` lightest packs, the pair that leaves the larger of the
    two packs lightest, while that lowers the heaviest pack (at most :data:`MAX_SWAPS` swaps).

    Returns: the swap pairs examined.
    """
    examined = 0
    for _ in range(MAX_SWAPS):
        heavy = max(range(len(packs)), key=lambda k: (sums[k], -k))
        partners = [k for k in sorted(range(len(packs)), key=lambda k: (sums[k], k)) if k != heavy]
        for k in partners[:SWAP_PARTNERS]:
            examined += len(packs[heavy]) * len(packs[k])
            best = min(((max(sums[heavy] - moved, sums[k] + moved), a, b)
                        for a, i in enumerate(packs[heavy]) for b, j in enumerate(packs[k])
                        if (moved := loads[i] - loads[j]) > 0), default=None)
            if best is not None and best[0] < sums[heavy]:
                _, a, b = best
                i, j = packs[heavy][a], packs[k][b]
                packs[heavy][a], packs[k][b] = j, i
                sums[heavy] += loads[j] - loads[i]
                sums[k] += loads[i] - loads[j]
                break
        else:
            break
    return examined


def _count_moves(node_loads: list[float], counts: list[int], min_replicas: int = 1) -> Iterator[list[int]]:
    """Replica counts near ``counts``, none below ``min_replicas``, the likeliest first: one or more replicas from a
    donor (an expert with more than ``min_replicas``; the one whose load per replica rises least first) to a
    receiver (highest load per replica first); then two single moves at once (a change that helps only in two
    steps)."""
    donors = sorted((j for j, c in enumerate(counts) if c > min_replicas),
                    key=lambda j: (node_loads[j] / (counts[j] - 1), j))
    receivers = sorted(range(len(counts)), key=lambda j: (-node_loads[j] / counts[j], j))
    for d in donors:
        for r in receivers:
            for m in range(1, counts[d] - min_replicas + 1) if r != d else ():
                yield _moved(counts, [(d, r, m)])
    singles = [(d, r) for d in donors for r in receivers if r != d]  # built only once the moves above are spent
    for a, (d1, r1) in enumerate(singles):
        for d2, r2 in singles[a + 1:]:
            if (d2, r2) != (r1, d1) and (d1 != d2 or counts[d1] > min_replicas + 1):
                yield _moved(counts, [(d1, r1, 1), (d2, r2, 1)])


def _moved(counts: list[int], moves: list[tuple[int, int, int]]) -> list[int]:
    out = list(counts)
    for donor, receiver, m in moves:
        out[donor] -= m
        out[receiver] += m
    return out


def refine_node(node_loads: list[float], counts: list[int], start: NodePacking, num_ranks: int, target: float,
                work: int, min_replicas: int = 1) -> tuple[NodePacking, int]:
    """A packing of one node whose heaviest rank is at most ``start``'s, found by changing the replica counts.

    Try the counts of :func:`_count_moves` around ``counts`` (``start`` is EPLB's packing of them; none below
    ``min_replicas``), each packed with swaps; keep the first whose heaviest rank is lower, and repeat from there,
    until the heaviest rank is at most ``target`` (tokens), no candidate lowers it, or ``work`` is spent.

    Returns: the best packing found and the work left.
    """
    best = pack_node(node_loads, counts, num_ranks, swap=True)
    work -= best.work
    if best.peak >= start.peak:
        best = start
    while best.peak > target and work > 0:
        for trial in _count_moves(node_loads, counts, min_replicas):
            packed = pack_node(node_loads, trial, num_ranks, swap=True)
            work -= packed.work
            if packed.peak < best.peak * (1 - 1e-12):
                counts, best = trial, packed
                break
            if work <= 0:
                break
        else:
            break  # no candidate lowers the heaviest rank
    return best, work
