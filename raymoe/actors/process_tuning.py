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


# Generation-0 threshold of the serving driver's process (CPython's default is 700; see configure_driver_gc).
DRIVER_GC_GEN0_THRESHOLD = 50_000


def configure_driver_gc(gen0_threshold: int = DRIVER_GC_GEN0_THRESHOLD) -> int:
    """The garbage-collector policy of the serving driver's process: call it once, where the driver has started
    (ranks up, before the first request; ``raymoe.actors.driver_actor``). Returns the number of objects frozen.

    * The start-up heap is frozen (:func:`freeze_startup_heap`): a full collection then visits only the objects
      made since (the requests' own), not the million of torch, the tokenizer and the model.
    * The generation-0 threshold is raised from 700 to ``gen0_threshold``. CPython starts a young collection when
      its count of tracked allocations minus deallocations passes the threshold, and every step makes and drops
      hundreds of containers (batches, rows, output columns; more with more DP groups and requests), so at 700 a
      young collection ran about once a step with 32 groups, every tenth one also walked the middle generation,
      and the middle ones in turn led to full collections of every request's objects. Requests arriving while
      others finish hardly move the count (their objects replace freed ones), so what a young collection walks is
      not bounded by the threshold anyway; a higher one mostly makes collections, of every generation, rarer.
      The older generations keep CPython's thresholds.

    Measured on the driver with instantly answering ranks (``gc.callbacks``, CPU time in collections; two-core
    machine): 16 groups x 256 requests that keep finishing and arriving, 600 steps: 1790 collections, longest
    139 ms, 2.9 s in all with the start-up freeze alone; 3 collections, longest 37 ms, 58 ms in all with this
    policy. 32 groups x 256 decoding requests, 200 steps: 200 collections (two full ones of 49 ms) before, none
    after.
    """
    frozen = freeze_startup_heap()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
    return frozen
