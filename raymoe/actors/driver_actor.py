"""DriverActor: the driver's step loop in its own process, as a Ray actor.

The actor owns a :class:`~raymoe.actors.driver_service.DriverService` (the step loop thread, the schedulers, the
radix caches) and, through its executor, the ranks: in-process for a world of one rank, else ``RankWorker``
actors that are its children. The HTTP front end (``raymoe.deploy.engine_client.EngineClient``) talks to it
through three kinds of calls, none of them per token:

* :meth:`submit` hands over any number of new requests and aborts in one call;
* :meth:`outputs` is one long-lived Ray streaming generator that yields one :data:`OutputBatch` per loop
  iteration (batches that pile up while the caller is slow are merged into one message);
* :meth:`stats`, :meth:`healthy` for metrics and health checks.

Calls run in two concurrency groups, so that a busy output stream can never starve health checks and aborts:
``"stream"`` for :meth:`outputs`, ``"control"`` for the rest.
"""

from __future__ import annotations

import asyncio
import os
import threading

import ray

from raymoe.actors.driver_service import AddRequest, DriverService, EngineStats, OutputBatch
from raymoe.config import EngineConfig, ModelConfig

CONCURRENCY_GROUPS = {"control": 32, "stream": 2}


def start_driver_actor(config: EngineConfig):
    """Create the driver actor for ``config`` (no CPU reservation: its ranks reserve theirs); returns its handle.
    The caller waits for ``ready`` (loading the ranks may take minutes)."""
    cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(DriverActor)
    return cls.options(num_cpus=0, max_restarts=0).remote(config)


class DriverActor:
    """The driver as a Ray actor (created by :func:`start_driver_actor`).

    Args:
        config: the engine configuration (ranks, KV sizes, scheduler limits).
    """

    def __init__(self, config: EngineConfig):
        from raymoe.actors.factory import build_driver
        from raymoe.tokenizer import load_tokenizer

        if config.parallel.world_size == 1:  # the rank computes in this process
            import torch

            torch.set_num_threads(max(1, os.cpu_count() or 1))
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._early: OutputBatch = []  # published before anyone subscribed
        model_config = ModelConfig.from_hf(config.model)
        self.service = DriverService(build_driver(config, model_config, load_tokenizer(config.model)),
                                     publish=self._publish)

    def _publish(self, batch: OutputBatch) -> None:  # on the step loop thread
        with self._lock:
            if self._queue is None:
                self._early.extend(batch)
                return
            loop, q = self._loop, self._queue
        loop.call_soon_threadsafe(q.put_nowait, batch)

    @ray.method(concurrency_group="stream")
    async def outputs(self):
        """Ray streaming generator of :data:`OutputBatch` messages (call with ``num_returns="streaming"``).
        A newer call takes the subscription over; this one then ends."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            old_loop, old_q = self._loop, self._queue
            self._loop, self._queue = asyncio.get_running_loop(), q
            if self._early:
                q.put_nowait(self._early)
                self._early = []
        if old_q is not None:
            old_loop.call_soon_threadsafe(old_q.put_nowait, None)
        while True:
            batch = await q.get()
            if batch is None:
                return
            while not q.empty():  # merge what piled up: still one message
                more = q.get_nowait()
                if more is None:
                    yield batch
                    return
                batch = batch + more
            yield batch

    @ray.method(concurrency_group="control")
    async def submit(self, adds: list[AddRequest], aborts: list[str]) -> None:
        """Queue new requests, then aborts (see :meth:`DriverService.submit`)."""
        self.service.submit(adds, aborts)

    @ray.method(concurrency_group="control")
    async def stats(self) -> EngineStats:
        return self.service.stats()

    @ray.method(concurrency_group="control")
    async def healthy(self) -> bool:
        return self.service.healthy()

    @ray.method(concurrency_group="control")
    async def ready(self) -> bool:
        """True once the ranks are loaded (the constructor returned)."""
        return True

    @ray.method(concurrency_group="control")
    async def shutdown(self) -> None:
        """Stop the step loop and the ranks."""
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self.service.shutdown()
        self.service.driver.executor.shutdown()
