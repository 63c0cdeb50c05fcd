"""Process settings of a CPU rank: the priority of the thread that runs its steps.

Ranks of a multi-rank engine meet in a collective at every MoE layer, so on a machine they share with the HTTP
front end, the driver, Ray and a load generator, a rank that waits for a core stalls every rank.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

DEFAULT_RANK_NICE = -10
"""Nice value of the thread that runs a CPU rank's steps in a multi-rank engine, unless configured
(``EngineConfig.cpu_rank_nice``)."""


def raise_step_thread_priority(nice: int | None) -> int | None:
    """Give the calling thread (the one that runs a CPU rank's steps) nice value ``nice``; returns the value set, or
    None when ``nice`` is None or the process may not raise its priority (no root or CAP_SYS_NICE: a warning).

    Why: the ranks of a multi-rank engine meet in a collective at every MoE layer, so a rank that the kernel
    preempts for the HTTP front end, the driver, Ray or a load generator stalls every rank at the next exchange,
    and its waiting peers leave their cores idle meanwhile. With a higher weight a woken rank preempts those
    processes at once, and they run while the ranks wait for each other or for the next step. The cost is CPU
    the HTTP front end does not get while the ranks compute, so TTFT grows at high concurrency; -10 rather than
    -20 leaves it about ten times the share (served dp=2 ep=2 at c=64: TTFT p50 268 / 462 / 579 ms with the ranks at
    nice 0 / -10 / -20). Threads the calling
    thread starts later (torch's intra-op pool) inherit the value; the rest of the process keeps its own.
    """
    if nice is None:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as e:
        logger.warning("rank step thread keeps its priority: cannot set nice %d (%s); set cpu_rank_nice=0 to skip",
                       nice, e)
        return None
    return nice
