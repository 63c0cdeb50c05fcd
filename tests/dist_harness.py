"""Run a function on N gloo ranks in spawned processes (for multi-rank tests below the Ray layer).

``run_ranks(fn, parallel, *args)`` delegates to ``raymoe.bench.ranks.spawn_ranks`` (one thread per rank) with a
test-sized timeout: a rank that raises makes it raise with the rank's traceback; a hang is cut off.
"""

from __future__ import annotations

from raymoe.bench.ranks import spawn_ranks
from raymoe.config import ParallelConfig


def run_ranks(fn, parallel: ParallelConfig, *args, timeout_s: float = 240.0, cpu_comm: str = "auto") -> list:
    """Run ``fn(groups, *args)`` on every rank; returns the results in rank order."""
    return spawn_ranks(fn, parallel, *args, threads_per_rank=1, timeout_s=timeout_s, cpu_comm=cpu_comm)
