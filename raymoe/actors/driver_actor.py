"""DriverActor: the driver's step loop in its own process, as a Ray actor.

The actor owns a :class:`~raymoe.actors.driver_service.DriverService` (the step loop thread, the schedulers, the
radix caches) and, through its executor, the ranks: in-process for a world of one rank, else ``RankWorker``
actors that are its children. It runs on the front end's node (``raymoe.deploy.engine_client.EngineClient``), and
the hot traffic between the two goes over one Unix-domain socket (``raymoe.actors.channel``), never one Ray call
per request or token:

* the step loop sends one :data:`OutputBatch` per iteration (every request's new tokens, finishes, refusals);
* a reader thread takes ``(adds, aborts)`` messages from the front end and hands them to the loop.

Ray calls remain for the rest: :meth:`connect` (once), :meth:`stats`, :meth:`healthy`, :meth:`ready`,
:meth:`shutdown`.
"""

from __future__ import annotations

import logging
import threading

import ray

from raymoe.actors.channel import connect_channel
from raymoe.actors.driver_service import DriverService, EngineStats, OutputBatch
from raymoe.actors.process_tuning import rank_cpu_threads
from raymoe.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)


def start_driver_actor(config: EngineConfig):
    """Create the driver actor for ``config`` on this node (the channel is a local socket; no CPU reservation:
    its ranks reserve theirs); returns its handle. The caller waits for ``ready`` (loading the ranks may take
    minutes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raymoe.runner.device import engine_device

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    # World size 1: the rank computes in this actor, which then needs the GPU (Ray hides GPUs from actors that
    # do not ask for one, and the rank would fail with RankDeviceError).
    gpus = 1 if config.parallel.world_size == 1 and engine_device(config.device) == "cuda" else 0
    cls = ray.remote(DriverActor).options(num_cpus=0, num_gpus=gpus, max_restarts=0, max_concurrency=4,
                                          scheduling_strategy=here)
    return cls.remote(config)


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

            torch.set_num_threads(rank_cpu_threads(config.cpu_threads, ranks_on_node=1))
        self._lock = threading.Lock()
        self._conn = None
        self._early: OutputBatch = []  # published before the front end connected
        model_config = ModelConfig.from_hf(config.model)
        self.service = DriverService(build_driver(config, model_config, load_tokenizer(config.model)),
                                     publish=self._publish)

    def _publish(self, batch: OutputBatch) -> None:  # on the step loop thread
        with self._lock:
            if self._conn is None:
                self._early.extend(batch)
                return
            try:
                self._conn.send(batch)
            except OSError:  # the front end went away; its requests are aborted by the reader
                pass

    def connect(self, path: str, authkey: bytes) -> bool:
        """Connect to the front end's channel at ``path`` and start serving it (a second call replaces the first).

        Raises:
            OSError: no listener at ``path`` on this node. multiprocessing.AuthenticationError: wrong key.
        """
        conn = connect_channel(path, authkey)
        with self._lock:
            old, self._conn = self._conn, conn
            if self._early:
                conn.send(self._early)
                self._early = []
        if old is not None:
            old.close()
        threading.Thread(target=self._read, args=(conn,), name="raymoe-channel-reader", daemon=True).start()
        return True

    def _read(self, conn) -> None:
        while True:
            try:
                adds, aborts = conn.recv()
            except (EOFError, OSError):
                log.info("the front end closed its channel")
                return
            self.service.submit(adds, aborts)

    def stats(self) -> EngineStats:
        return self.service.stats()

    def healthy(self) -> bool:
        return self.service.healthy()

    def ready(self) -> bool:
        """True once the ranks are loaded (the constructor returned)."""
        return True

    def shutdown(self) -> None:
        """Stop the step loop and the ranks."""
        self.service.shutdown()
        self.service.driver.executor.shutdown()
