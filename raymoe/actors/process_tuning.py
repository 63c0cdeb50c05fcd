"""Process settings for raymoe's long-lived serving processes: the rank actors, the driver actor (which also runs
the rank of a one-rank world) and the HTTP front end."""

from __future__ import annotations

import gc
import logging
import os
import threading

logger = logging.getLogger(__name__)

DEFAULT_RANK_NICE = -10
"""Nice value of the thread that runs a CPU rank's steps in a multi-rank engine, unless configured
(``EngineConfig.cpu_rank_nice``)."""


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


def raise_step_thread_priority(nice: int | None) -> int | None:
    """Give the calling thread (the one that runs a CPU rank's steps) nice value ``nice``; returns the value set, or
    None when ``nice`` is None or the process may not raise its priority (no root or CAP_SYS_NICE: a warning).

    Why: the ranks of a multi-rank engine meet in a collective at every MoE layer, so a rank that the kernel
    preempts for the HTTP front end, the driver, Ray or a load generator stalls every rank at the next exchange,
    and its waiting peers leave their cores idle meanwhile. With a higher weight a woken rank preempts those
    processes at once, and they run while the ranks wait for each other or for the next step. The cost is CPU
    the HTTP front end does not get while the ranks compute, so TTFT grows at high concurrency; -10 rather than
    -20 leaves it about ten times the share (docs/performance.md has the served figures). Threads the calling
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


def set_engine_process_nice(nice: int = 0) -> bool:
    """Give every thread of this process nice value ``nice`` (threads started later inherit it from their creator).

    Ray's raylet starts worker processes, actors included, at nice 15 (its ``worker_niceness``), behind the HTTP
    front end, the clients and Ray's own daemons at 0. An engine actor (the driver, a rank) is on the serving
    path, so it puts itself back at ``nice``. Returns False, with a warning, where that needs a privilege this
    process lacks (raising priority needs root or CAP_SYS_NICE; a local cluster that raymoe starts runs its
    workers at 0 anyway, ``raymoe.cluster.bootstrap.init_ray``).
    """
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # a thread that ended meanwhile; the others still get the value
            continue
        except OSError as e:
            logger.warning("engine actor keeps Ray's worker niceness: cannot set nice %d (%s)", nice, e)
            return False
    return True


def freeze_startup_heap() -> int:
    """Collect garbage once, then exempt every object alive now from later cyclic collections (``gc.freeze``).
    Call it when a serving process has finished starting (weights loaded, graphs captured, app built).
    Returns the number of objects frozen.

    Why: CPython's full (generation-2) collection visits every tracked container object. A process that has
    imported torch, a tokenizer and the web framework and built a model holds a million of them, so a full
    collection stops it for about 90-160 ms on the CI machine (measured with ``gc.callbacks`` in the serving front
    end at 16 streams, docs/performance.md). In the front end every stream stalls for that long; in a rank, every
    rank waits at the next exchange. After the freeze a collection visits only the objects made since, which the
    request path keeps few. Objects frozen here are still freed by reference counting when released; only cycles
    among them are never collected, and the ``gc.collect()`` before the freeze clears the ones made at start-up.
    The same is done by vLLM's server after start-up (CPython documents ``gc.freeze`` for this use).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
