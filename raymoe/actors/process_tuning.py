"""Process settings for the processes that run engine steps (rank actors, the driver actor of a one-rank world)."""

from __future__ import annotations

import os


def rank_cpu_threads(requested: int | None, ranks_on_node: int) -> int:
    """Intra-op threads for one CPU rank: ``requested``, else ``(cores - 1) // ranks_on_node`` and at least 1.

    One core is left to the processes beside the ranks (HTTP front end, driver loop, Ray, a load generator):
    torch's parallel regions wait for their slowest thread, so a rank whose threads share a core with them runs
    each step at the pace of the busiest core (on the 2-core CI machine, serving at 2 threads gave about half the
    throughput of 1 thread: ``raymoe bench compare``, docs/performance.md).
    """
    if requested is not None:
        return requested
    return max(1, ((os.cpu_count() or 1) - 1) // max(1, ranks_on_node))
