"""DriverActor: the driver's step loop in its own process, as a Ray actor.

The actor owns a :class:`~raymoe.actors.driver_service.DriverService` (the step loop thread, the schedulers, the
radix caches) and, through its executor, the ranks: in-process for a world of one rank, else ``RankWorker``
actors that are its children. It runs on the front end's node (``raymoe.client.engine_client.EngineClient``), and
the hot traffic between the two goes over one Unix-domain socket (``raymoe.actors.channel``), never one Ray call
per request or token:

* the step loop sends one :data:`OutputBatch` per iteration (every request's new tokens, finishes, refusals);
* a reader thread takes ``(adds, aborts)`` messages from the front end and hands them to the loop.

Several front ends may serve one engine (``raymoe.actors.frontends``): each connects with its id, gets the rows of
its own requests only (from this actor and from each DP group process), and when its channel closes its in-flight
requests are aborted.

Ray calls remain for the rest: :meth:`connect` (once per front-end connection), :meth:`stats`, :meth:`healthy`,
:meth:`ready`, :meth:`shutdown`. The health and state calls (and the fault-injection hooks of the tests) run in
their own concurrency group (``"control"``), so a busy default group can never starve them.

The actor is restarted by Ray when its process dies (``max_restarts``; the ranks, its children, die with it and
the new instance starts fresh ones). The front end sees its channel close, fails its in-flight requests and
reconnects (``raymoe.client.engine_client``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import ray

from raymoe.actors.channel import connect_channel
from raymoe.actors.driver_service import DriverService, EngineStats, RequestError
from raymoe.actors.frontends import OutputFanout, frontend_of
from raymoe.actors.output_batch import OutputBatch, RequestEnd
from raymoe.actors.weight_update import WeightUpdate, WeightUpdateResult, rank_executor
from raymoe.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)


# Restarts Ray gives a driver actor whose process died (-1: unbounded; each restart reloads the ranks).
DRIVER_MAX_RESTARTS = -1
_CONTROL = "control"  # concurrency group of the health, state and test-hook calls
_KV = "kv"  # KV transfers of prefill/decode disaggregation: long calls, kept apart from stats and health
_WEIGHTS = "weights"  # weight updates: wait for the requests in flight and the ranks' load (minutes)


ENGINE_NAMESPACE = "raymoe"
"""The Ray namespace of named engines (a front end in another Ray job finds them there: ``find_driver_actor``)."""


def start_driver_actor(config: EngineConfig, max_restarts: int = DRIVER_MAX_RESTARTS, name: str | None = None):
    """Create the driver actor for ``config`` (resolved: ``raymoe.cluster.device_choice``) on this node (the channel
    is a local socket; no CPU reservation: its ranks reserve theirs); returns its handle. The caller waits for
    ``ready`` (loading the ranks may take minutes). Ray restarts the actor up to ``max_restarts`` times (-1:
    always) when its process dies. ``name``: register it under this name in :data:`ENGINE_NAMESPACE`, so more
    front ends can attach to the engine (``EngineClient.attach``).

    Raises:
        ValueError: ``config`` is not resolved, or ``name`` is taken by a live actor (Ray's message).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raymoe.actors.factory import require_resolved

    require_resolved(config)
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    # World size 1: the rank computes in this actor, which then needs the GPU (Ray hides GPUs from actors that
    # do not ask for one, and the rank would fail with RankDeviceError). Otherwise its rank actors ask for theirs.
    gpus = 1 if config.parallel.world_size == 1 and config.device == "cuda" else 0
    cls = ray.remote(concurrency_groups={_CONTROL: 2, _KV: 8, _WEIGHTS: 2}, max_concurrency=4)(DriverActor)
    named = {"name": name, "namespace": ENGINE_NAMESPACE} if name else {}
    return cls.options(num_cpus=0, num_gpus=gpus, max_restarts=max_restarts, max_task_retries=0,
                       scheduling_strategy=here, **named).remote(config)


def find_driver_actor(name: str):
    """The driver actor of the engine started under ``name`` (``start_driver_actor``).

    Raises:
        ValueError: no live engine has that name (Ray's message).
    """
    return ray.get_actor(name, namespace=ENGINE_NAMESPACE)


def _abort_frontend(driver, frontend: str) -> int:
    """Abort every in-flight request of front end ``frontend`` (on the driver loop's thread); returns how many."""
    rids = [rid for rid in driver.group_of if frontend_of(rid) == frontend]
    for rid in rids:
        driver.abort_request(rid)
    return len(rids)


def _inject_same_step_error(workers: list) -> None:
    """Make every rank raise in the same step: the first step after now when the ranks are idle (their counts do
    not move), else one well ahead of the furthest rank (the ranks step on their own threads while the injection
    arrives, so "the next step" would not be the same step everywhere and the ranks would fall out of step).

    Raises:
        RuntimeError: a rank had passed the chosen step when the injection reached it (the steps ran faster than
            the margin assumed; nothing is injected anywhere).
    """
    counts = ray.get([w.step_count.remote() for w in workers], timeout=30)
    time.sleep(0.05)
    again = ray.get([w.step_count.remote() for w in workers], timeout=30)
    at = max(again) + (1 if again == counts else 256)
    if not all(ray.get([w.inject_step_errors.remote(1, at) for w in workers], timeout=30)):
        ray.get([w.inject_step_errors.remote(0) for w in workers], timeout=30)
        raise RuntimeError(f"a rank passed step {at} before the injected error reached it")


class DriverActor:
    """The driver as a Ray actor (created by :func:`start_driver_actor`).

    Args:
        config: the engine configuration (ranks, KV sizes, scheduler limits).
    """

    def __init__(self, config: EngineConfig):
        from raymoe.actors.factory import build_driver
        from raymoe.actors.process_tuning import configure_driver_gc, set_engine_process_nice
        from raymoe.tokenizer import load_tokenizer

        set_engine_process_nice()

        if config.parallel.world_size == 1:  # the rank computes in this process
            from raymoe.platform.selector import select_platform

            select_platform(config.device).set_rank_threads(config.cpu_threads, ranks_on_node=1)
        self.config = config
        self._outputs = OutputFanout(self._send_batch)  # one connection per front end (raymoe.actors.frontends)
        self.model_config = model_config = ModelConfig.from_hf(config.model)
        self.service = DriverService(build_driver(config, model_config, load_tokenizer(config.model)),
                                     publish=self._outputs.publish)
        configure_driver_gc()  # ranks (and a one-rank world's model) are up: start-up heap frozen, rarer collections

    def _send_batch(self, conn, batch: OutputBatch) -> None:  # on the step loop thread, under the fanout's lock
        try:
            conn.send(batch)
        except OSError:
            raise
        except Exception:  # noqa: BLE001 - a row that cannot be pickled: send the others, fail that one
            log.exception("an output batch could not be sent; sending its rows one by one")
            self._send_one_by_one(conn, batch)

    def _send_one_by_one(self, conn, batch: OutputBatch) -> None:
        for delta in batch:
            row = OutputBatch()
            row.add(delta.request_id, delta.token_ids, delta.completion_tokens, delta.logprobs,
                    prompt_logprobs=delta.prompt_logprobs)
            try:
                conn.send(row)
            except OSError:
                return
            except Exception:  # noqa: BLE001
                err = RequestError("failed", "the request's output could not be sent to the front end")
                self.service.submit(aborts=[delta.request_id])
                failed = OutputBatch()
                failed.end(delta.request_id, RequestEnd(error=err))
                conn.send(failed)

    def connect(self, path, authkey: bytes, frontend: str = "") -> bool:
        """Connect to front end ``frontend``'s channel at ``path`` (a Unix socket path, or ``(host, port)``) and
        serve it: its requests and aborts in, its requests' rows out (``raymoe.actors.frontends``; a second call
        for the same front end replaces its first). DP group processes connect to it too.

        Raises:
            OSError: no listener at ``path`` on this node. multiprocessing.AuthenticationError: wrong key.
        """
        conn = connect_channel(path, authkey)
        connect_outputs = getattr(self.service.driver.executor, "connect_outputs", None)
        if connect_outputs is not None:  # DP group processes send their rows to the front end themselves
            connect_outputs(path, authkey, frontend)
        old = self._outputs.connect(frontend, conn)
        if old is not None:
            old.close()
        threading.Thread(target=self._read, args=(conn, frontend), name="raymoe-channel-reader", daemon=True).start()
        return True

    @ray.method(concurrency_group=_CONTROL)
    def engine_config(self) -> EngineConfig:
        """The engine's resolved configuration (what an attaching front end needs: model, context length, faults)."""
        return self.config

    @ray.method(concurrency_group=_CONTROL)
    def frontends(self) -> list[str]:
        """The ids of the front ends connected now (``""``: the one that started the engine)."""
        return self._outputs.frontends

    def _read(self, conn, frontend: str) -> None:
        while True:
            try:
                adds, aborts = conn.recv()
            except (EOFError, OSError):
                log.info("front end %r closed its channel", frontend)
                self._frontend_gone(frontend, conn)
                return
            self.service.submit(adds, aborts)

    def _frontend_gone(self, frontend: str, conn) -> None:
        """Front end ``frontend`` went away (its channel closed and was not replaced): stop sending it rows and
        abort its in-flight requests, which frees their KV."""
        if not self._outputs.drop(frontend, conn):
            return  # replaced by a newer connection of the same front end
        disconnect = getattr(self.service.driver.executor, "disconnect_outputs", None)
        try:
            if disconnect is not None:
                disconnect(frontend)
            ended = self.service.call(lambda driver: _abort_frontend(driver, frontend), timeout_s=10.0)
        except Exception as e:  # noqa: BLE001 - the engine is shutting down or recovering: nothing to free
            log.info("front end %r: its requests were not aborted (%s)", frontend, type(e).__name__)
            return
        if ended:
            log.warning("front end %r went away; aborted its %d in-flight requests", frontend, ended)

    @ray.method(concurrency_group=_CONTROL)
    def stats(self) -> EngineStats:
        """Counters, gauges, health and the idle invariant (see ``EngineStats``)."""
        return self.service.stats()

    @ray.method(concurrency_group=_CONTROL)
    def cached_blocks(self) -> list[int]:
        """The block hashes of every prefix the engine's radix caches hold (``raymoe.kvcache.prefix_events``; empty
        with ``load_balance_method="shortest_queue"``)."""
        return self.service.driver.router.held_blocks()

    @ray.method(concurrency_group=_CONTROL)
    def rebalance_experts(self) -> bool:
        """Ask for an expert rebalance at the next step; False when the engine was started without enable_eplb."""
        return self.service.rebalance_experts()

    @ray.method(concurrency_group=_WEIGHTS)
    def update_weights(self, update: WeightUpdate) -> WeightUpdateResult:
        """Serve other weights (a folder, or tensors: pass them as an ``ObjectRef`` inside ``update``) once the
        requests in flight are done (``DriverService.update_weights``; new requests wait meanwhile); blocks until
        then."""
        load_timeout_s = getattr(rank_executor(self.service.driver.executor), "load_timeout_s", 600.0)
        if isinstance(update.tensors, ray.ObjectRef):  # a copy this actor owns: the caller's goes with the caller
            update = dataclasses.replace(update, tensors=ray.put(ray.get(update.tensors)))
        return self.service.update_weights(update, self.model_config, load_timeout_s)

    @ray.method(concurrency_group=_CONTROL)
    def healthy(self) -> bool:
        """Whether the step loop is alive and serving and the ranks are up."""
        return self.service.healthy()

    @ray.method(concurrency_group=_CONTROL)
    def ready(self) -> bool:
        """True once the ranks are loaded (the constructor returned)."""
        return True

    @ray.method(concurrency_group=_CONTROL)
    def abort(self, request_ids: list[str]) -> None:
        """Abort requests by id (the channel is the usual way; this one cannot be held up by it)."""
        self.service.submit(aborts=list(request_ids))

    @ray.method(concurrency_group=_CONTROL)
    def inject_fault(self, kind: str) -> None:
        """Fault injection for tests: ``"loop_death"`` / ``"loop_error"`` (see ``DriverService.inject_fault``),
        ``"rank_step_error"`` (every rank raises in its next step), ``"exit"`` (this process exits at once, as a
        crash would; Ray restarts the actor).

        Raises:
            ValueError: an unknown ``kind``.
        """
        if kind == "exit":
            os._exit(1)
        if kind == "rank_step_error":
            executor = self.service.driver.executor
            workers = getattr(executor, "workers", None)
            if workers is None:
                executor.worker.inject_step_errors(1)
            else:
                _inject_same_step_error(workers)
            return
        self.service.inject_fault(kind)

    @ray.method(concurrency_group=_CONTROL)
    def pids(self) -> list[int]:
        """Process ids of this actor and of its rank actors (memory figures of the benchmarks)."""
        executor = self.service.driver.executor
        groups = executor.pids() if hasattr(executor, "pids") else []
        return [os.getpid(), *ray.get([w.pid.remote() for w in self.rank_actors()], timeout=30), *groups]

    # ------------------------------------------------------------- prefill/decode disaggregation (pd_client)
    def _on_ranks(self, method: str, calls: list[tuple[int, tuple]], timeout_s: float) -> list:
        """Call ``method`` on the given ranks (rank index, args) at once and wait for all of them."""
        workers = self.rank_actors()
        if not workers:  # a world of one rank computes in this process
            worker = self.service.driver.executor.worker
            return [getattr(worker, method)(*args) for _, args in calls]
        refs = [getattr(workers[rank], method).remote(*args) for rank, args in calls]
        return ray.get(refs, timeout=timeout_s)

    def _group_ranks(self, group: int) -> list[int]:
        tp = self.service.driver.config.parallel.tp_size
        return list(range(group * tp, (group + 1) * tp))

    @ray.method(concurrency_group=_KV)
    def start_kv_transfer(self, name: str, backend: str = "auto") -> list[bytes]:
        """Start a KV transfer agent on every rank (named ``{name}-r{rank}``); returns their metadata in rank
        order (``RankKVTransfer.start_kv_transfer``)."""
        world = self.service.driver.config.parallel.world_size
        return self._on_ranks("start_kv_transfer", [(r, (f"{name}-r{r}", backend)) for r in range(world)], 120)

    @ray.method(concurrency_group=_KV)
    def add_kv_peers(self, metadata: list[bytes]) -> list[list[str]]:
        """Give every rank the other engine's ranks' metadata; returns each rank's peer names."""
        world = self.service.driver.config.parallel.world_size
        return self._on_ranks("add_kv_peers", [(r, (list(metadata),)) for r in range(world)], 120)

    @ray.method(concurrency_group=_KV)
    def send_kv(self, group: int, peers: list[str], src_slots: list[int], dst_slots: list[int], tag: str,
                timeout_s: float) -> None:
        """Each tp rank of ``group`` writes the rows of ``src_slots`` into the same tp rank of the peer group
        (``peers``: one agent name per tp rank)."""
        calls = [(r, (peers[t], src_slots, dst_slots, tag, timeout_s)) for t, r in enumerate(self._group_ranks(group))]
        self._on_ranks("send_kv", calls, timeout_s + 30)

    @ray.method(concurrency_group=_KV)
    def receive_kv(self, group: int, peers: list[str], dst_slots: list[int], tag: str, timeout_s: float) -> None:
        """Each tp rank of ``group`` waits for its peer's rows in ``dst_slots``."""
        calls = [(r, (peers[t], dst_slots, tag, timeout_s)) for t, r in enumerate(self._group_ranks(group))]
        self._on_ranks("receive_kv", calls, timeout_s + 30)

    @ray.method(concurrency_group=_KV)
    def expect_kv(self, group: int, tag: str, timeout_s: float) -> None:
        """Each tp rank of ``group`` expects the streamed rows of ``tag`` (``RankKVTransfer.expect_kv``)."""
        self._on_ranks("expect_kv", [(r, (tag, timeout_s)) for r in self._group_ranks(group)], 60)

    @ray.method(concurrency_group=_KV)
    def forget_kv(self, group: int, tag: str) -> None:
        """Each tp rank of ``group`` stops expecting ``tag`` (``RankKVTransfer.forget_kv``)."""
        self._on_ranks("forget_kv", [(r, (tag,)) for r in self._group_ranks(group)], 60)

    @ray.method(concurrency_group=_KV)
    def reserve_kv(self, rid: str, num_tokens: int) -> tuple[int, list[int]] | None:
        """Decode side: ``Driver.reserve_kv`` on the loop thread."""
        return self.service.call(lambda d: d.reserve_kv(rid, num_tokens))

    @ray.method(concurrency_group=_KV)
    def cancel_reservation(self, rid: str) -> bool:
        return self.service.call(lambda d: d.cancel_reservation(rid))

    @ray.method(concurrency_group=_KV)
    def kv_export(self, rid: str) -> tuple[int, list[int], bool] | None:
        """Prefill side: ``Driver.kv_export`` on the loop thread."""
        return self.service.call(lambda d: d.kv_export(rid))

    def kv_stream_settled(self, rid: str) -> bool:
        """Prefill side: ``Driver.kv_stream_settled`` on the loop thread."""
        return self.service.call(lambda d: d.kv_stream_settled(rid))

    @ray.method(concurrency_group=_KV)
    def release_export(self, rid: str) -> bool:
        return self.service.call(lambda d: d.release_export(rid))

    @ray.method(concurrency_group=_KV)
    def read_kv(self, rank: int, slots: list[int]):
        """The rows of ``slots`` of one rank's KV buffers (flat uint8; tests check transfers with it)."""
        return self._on_ranks("read_kv", [(rank, (slots,))], 60)[0]

    @ray.method(concurrency_group=_CONTROL)
    def rank_actors(self) -> list:
        """Handles of the rank actors (empty for a world of one rank, which computes in this process)."""
        return list(getattr(self.service.driver.executor, "workers", []))

    @ray.method(concurrency_group=_CONTROL)
    def group_actors(self) -> list:
        """Handles of the DP group scheduler actors (empty when the groups run in this process)."""
        return list(getattr(self.service.driver.executor, "actors", []))

    def shutdown(self) -> None:
        """Stop the step loop and the ranks."""
        self.service.shutdown()
        self.service.driver.executor.shutdown()
