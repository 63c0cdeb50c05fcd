"""The start of a multi-rank world once its actors exist: rendezvous, weights, decode graphs, each stage bounded
and reported (``raymoe.actors.startup_progress``); ``RayExecutor`` calls :func:`start_rank_group`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raymoe.actors.startup_progress import Progress, wait_all


@dataclass(frozen=True)
class RankGroupTimeouts:
    """Bounds of a rank group's start, seconds.

    Attributes:
        init_s: rendezvous and joining the process groups. load_s: loading the weights and capturing the decode
            graphs, both stages together (``StartupConfig.load_timeout_s`` or derived). collective_s: the
            ``torch.distributed`` timeout of every collective.
    """

    init_s: float
    load_s: float
    collective_s: float


def rank_actor(placement, runner_cfg, parallel, rank: int):
    """A ``RankWorker`` actor of ``parallel``'s rank ``rank`` in ``placement``'s bundle (``RankPlacement``),
    never restarted by Ray (the executor decides what a lost rank costs)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raymoe.actors.rank_worker import RankWorker

    strategy = PlacementGroupSchedulingStrategy(placement_group=placement.pg,
                                                placement_group_bundle_index=placement.bundle_index)
    return ray.remote(RankWorker).options(num_cpus=placement.num_cpus, num_gpus=placement.num_gpus, max_restarts=0,
                                          scheduling_strategy=strategy).remote(runner_cfg, parallel, rank)


def start_rank_group(workers: Sequence[Any], timeouts: RankGroupTimeouts, progress: Progress | None = None) -> None:
    """Join every rank to the world (rank 0's rendezvous address), load every shard, then capture every rank's
    decode graphs; one progress line per stage.

    Args:
        workers: the ``RankWorker`` actor handles, in rank order.
    Raises:
        TimeoutError: a stage passed its bound. Exception: a rank's own error (``RankDeviceError`` ...).
    """
    import time

    import ray

    def say(line: str) -> None:
        if progress is not None:
            progress(line)

    n = len(workers)
    t0 = time.monotonic()
    addr = ray.get(workers[0].get_rendezvous_address.remote(), timeout=timeouts.init_s)
    wait_all([w.init_distributed.remote(addr, timeouts.collective_s) for w in workers], timeouts.init_s,
             "joining the process groups", progress, "init_timeout_s")
    say(f"{n} ranks joined their process groups in {time.monotonic() - t0:.1f} s")
    t1 = time.monotonic()
    load_s = wait_all([w.load.remote(capture_graphs=False) for w in workers], timeouts.load_s,
                      "loading weights", progress, "load_timeout_s")
    say(f"weights loaded on {n} ranks in {time.monotonic() - t1:.1f} s (slowest rank {max(load_s):.1f} s)")
    left = max(timeouts.load_s - (time.monotonic() - t1), 1.0)
    captured = wait_all([w.capture_graphs.remote(freeze_heap=True) for w in workers], left,
                        "capturing decode graphs", progress, "load_timeout_s")
    graphs, seconds = max(c[0] for c in captured), max(c[1] for c in captured)
    say(f"{graphs} decode graphs captured per rank (slowest rank {seconds:.1f} s); ranks ready "
        f"{time.monotonic() - t0:.1f} s after placement")
