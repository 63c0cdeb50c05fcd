"""Process settings for raymoe's long-lived serving processes on every platform: the rank actors, the driver actor
and the HTTP front end. (Settings of a CPU rank's compute, its threads and step-thread priority, are the CPU
platform's: ``raymoe.platform.cpu.process``.)"""

from __future__ import annotations

import gc
import logging
import os
import threading

logger = logging.getLogger(__name__)


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

    Why: CPython's full (generation-2) collection visits every tracked container object. A process that has imported
    torch, a tokenizer and the web framework and built a model holds a million of them, so a full collection stops
    it for about 90-160 ms on the CI machine (measured with ``gc.callbacks`` in the serving front end at 16 streams:
    86-156 ms per generation-2 collection, 1.6 ms the largest after the freeze). In the front end every stream
    stalls for that long; in a rank, every rank waits at the next exchange. After the freeze a collection visits
    only the objects made since, which the request path keeps few. Objects frozen here are still freed by reference
    counting when released; only cycles among them are never collected, and the ``gc.collect()`` before the freeze
    clears the ones made at start-up. The same is done by vLLM's server after start-up (CPython documents
    ``gc.freeze`` for this use).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
