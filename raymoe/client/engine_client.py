"""EngineClient: the HTTP front end's side of a driver actor (streaming generate, abort, stats, health).

The engine's step loop never runs in the HTTP process: it lives in a :class:`~raymoe.actors.driver_actor.DriverActor`
(its own process, also for a single rank) on this node. Requests, aborts and outputs travel over one local socket
(``raymoe.actors.channel``): the front end sends each new request or abort as it comes; the driver sends one
message per step carrying the deltas of every request that advanced, which a reader thread routes to the
per-request asyncio queues (one event-loop wake-up per step and event loop, not one per request).

The front end tokenizes, applies chat templates, detokenizes and writes SSE; the engine sees token ids only.

When the driver actor's process dies, the channel reaches EOF: the reader ends every in-flight request with an
``"unhealthy"`` error at once, reports unhealthy, and reconnects to the actor once Ray has restarted it (or starts a
fresh one when Ray gave up on it). New requests arriving meanwhile are refused as unhealthy.

An in-flight request that ends with an ``"unhealthy"`` error (that, a rank fault, a dead driver loop) is resumed
(``raymoe.client.request_resume``): its stream waits until the engine is healthy again and the request goes on from
the tokens it delivered, up to ``FaultConfig.max_request_resumes`` times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import wait
from pathlib import Path

from raymoe.actors.channel import ChannelListener
from raymoe.actors.driver_service import AddRequest, EngineStats, OutputBatch, RequestDelta, RequestError
from raymoe.actors.frontends import FRONTEND_SEP, engine_request_id
from raymoe.actors.weight_update import WeightUpdate, WeightUpdateResult
from raymoe.client.request_resume import ResumableRequest
from raymoe.config import EngineConfig, ModelConfig
from raymoe.errors import EngineUnhealthyError
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.kv_stream import KVStreamTarget
from raymoe.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_Route = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestDelta]"]


def last_error_line(e: BaseException) -> str:
    """The last line of a Ray error that names an exception (``"RankDeviceError: rank 0 ..."``: the error the
    driver actor's constructor raised), else the whole message."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if line.split(":", 1)[0].rsplit(".", 1)[-1].endswith(("Error", "Exception"))]
    return named[-1] if named else str(e)


def _deliver(items: list[tuple[asyncio.Queue, RequestDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


class EngineClient:
    """Starts a ``DriverActor`` on this node and serves requests through it.

    Args:
        config: engine configuration (ranks and KV sizes); its device is resolved here, after Ray is joined and
            before the driver actor starts (``raymoe.cluster.device_choice``; a resolved config comes back unchanged).
        model_name: served model name (default: the folder name).
        start_timeout_s: how long to wait for the driver and its ranks to come up, seconds (None: the engine's
            start-up budget, ``raymoe.actors.startup_budget``).
        engine_name: register the engine under this name, so more front-end processes can serve it
            (:meth:`attach`; ``raymoe.actors.frontends``).

    Attributes:
        config (resolved), device_choice (the device and why), model_config (normalized), model_name, tokenizer
        (the model's Hugging Face tokenizer).
        driver: the driver actor's handle (replaced when a fresh actor had to be started).
        reconnects: times the channel was re-established after the driver actor died.
        resumed_requests: times a request was submitted again after an engine fault or a weight update's
            retraction (``request_resume``).
        frontend_id: this front end's id among the engine's (``""``: the one that started it).
        engine_name: the engine's name (None: unnamed, no other front end can attach).

    Raises:
        InvalidRequestError: ``device="cuda"`` where Ray declares no GPU (names CUDA), or an option the device
            refuses.
        EngineUnhealthyError: the driver or its ranks failed to start (the rank's own error, e.g.
            ``RankDeviceError``, in the message).
        ray.exceptions.GetTimeoutError / TimeoutError: the driver or its ranks did not start in time.
    """

    def __init__(self, config: EngineConfig, model_name: str | None = None, start_timeout_s: float | None = None,
                 engine_name: str | None = None):
        import ray

        from raymoe.actors.driver_actor import start_driver_actor
        from raymoe.actors.startup_budget import startup_budget
        from raymoe.cluster.bootstrap import init_ray
        from raymoe.cluster.device_choice import resolve_engine_config
        from raymoe.config.model_rules import apply_model_rules

        init_ray(config.ray_address)
        model_config = ModelConfig.from_hf(config.model)
        config = apply_model_rules(config, model_config)  # what the model family cannot use
        resolved, self.device_choice = resolve_engine_config(config, serving=True)
        self._setup(resolved, model_name, start_timeout_s or startup_budget(resolved).engine_s, "", engine_name,
                    model_config)
        self.driver = start_driver_actor(self.config, name=engine_name)
        try:
            ray.get(self.driver.ready.remote(), timeout=self.start_timeout_s)
            self._conn = self._open_channel()
        except ray.exceptions.ActorDiedError as e:  # its constructor raised: the ranks did not start
            ray.kill(self.driver)
            raise EngineUnhealthyError(f"the engine failed to start: {last_error_line(e)}") from None
        except BaseException:
            ray.kill(self.driver)
            raise
        self._start_reader()

    @classmethod
    def attach(cls, engine_name: str, model_name: str | None = None, frontend_id: str | None = None,
               ray_address: str | None = None, timeout_s: float = 60.0) -> EngineClient:
        """A further front end of the running engine registered as ``engine_name`` (``EngineClient(...,
        engine_name=...)``): it submits its own requests and receives only their outputs, from the driver and
        from each DP group process directly (``raymoe.actors.frontends``). :meth:`shutdown` closes this front end
        only; when it goes away the engine aborts its in-flight requests.

        Args:
            frontend_id: this front end's id (default: a random one); unique among the engine's front ends.

        Raises:
            ValueError: no engine has that name, or ``frontend_id`` is empty or holds ``FRONTEND_SEP``.
            TimeoutError / ray exceptions: the engine did not answer within ``timeout_s`` seconds.
        """
        import uuid

        import ray

        from raymoe.actors.driver_actor import find_driver_actor
        from raymoe.cluster.bootstrap import init_ray

        frontend_id = uuid.uuid4().hex[:12] if frontend_id is None else frontend_id
        if not frontend_id or FRONTEND_SEP in frontend_id:
            raise ValueError(f"frontend_id must be non-empty and free of {FRONTEND_SEP!r}, got {frontend_id!r}")
        init_ray(ray_address)
        driver = find_driver_actor(engine_name)
        self = cls.__new__(cls)
        self._setup(ray.get(driver.engine_config.remote(), timeout=timeout_s), model_name, timeout_s, frontend_id,
                    engine_name)
        self.device_choice = None
        self.driver = driver
        self._conn = self._open_channel()
        self._start_reader()
        return self

    def _setup(self, config: EngineConfig, model_name: str | None, start_timeout_s: float, frontend_id: str,
               engine_name: str | None, model_config: ModelConfig | None = None) -> None:
        self.config, self.start_timeout_s = config, start_timeout_s
        self.frontend_id, self.engine_name = frontend_id, engine_name
        self.model_config = model_config or ModelConfig.from_hf(config.model)
        self.model_name = model_name or Path(config.model).name
        self.tokenizer = load_tokenizer(config.model)
        self.reconnects = 0
        self.resumed_requests = 0
        self._probe_lock = threading.Lock()
        self._probe = (0.0, False)  # (when, healthy) of the last health probe a resuming request made
        self._streams: dict[str, _Route] = {}  # by engine request id (``raymoe.actors.frontends``)
        self._send_lock = threading.Lock()
        self._dead: str | None = None
        self._closing = False
        self._channel: ChannelListener | None = None

    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read_outputs, name="raymoe-output-reader", daemon=True)
        self._reader.start()

    @property
    def max_context_len(self) -> int:
        """Longest prompt + output the engine accepts, tokens."""
        return min(self.config.cache.max_context_len, self.model_config.max_position_embeddings)

    # ------------------------------------------------------------------ channel
    def _open_channel(self):
        """A fresh channel to the (ready) driver actor; replaces the previous one.

        Raises:
            TimeoutError / ray exceptions: the driver did not connect.
        """
        import ray

        channel = ChannelListener(host=self._channel_host())
        try:
            ray.get(self.driver.connect.remote(channel.path, channel.authkey, self.frontend_id), timeout=60)
            conn = channel.accept(timeout_s=60)
        except BaseException:
            channel.close()
            raise
        old, self._channel = self._channel, channel
        if old is not None:
            old.close()
        return conn

    def _channel_host(self) -> str | None:
        """TCP on this node's address when group processes (or, for an attached front end, the driver) may run on
        other nodes, else None (a Unix socket)."""
        import ray

        from raymoe.actors.factory import hosts_groups

        remote_peers = hosts_groups(self.config) or self.frontend_id
        if not remote_peers or sum(n["Alive"] for n in ray.nodes()) < 2:
            return None
        return ray.util.get_node_ip_address()

    def _read_outputs(self) -> None:
        while True:
            reason = self._pump(self._conn)
            if self._closing:
                return
            self._channel_lost(reason)
            if not self._reconnect():
                return

    def _pump(self, conn) -> str:
        """Route output batches from the driver's connection and the groups' to their streams until the driver's
        closes; returns why it closed. A group connection that closes is dropped (the driver ends its requests)."""
        channel = self._channel
        while True:
            try:
                ready = wait([conn, channel.wake, *channel.group_conns.values()])
            except OSError:  # a connection in the list was closed under it (the accept thread replaced a group's)
                if conn.closed:
                    return "the engine's channel was closed"
                for c in [c for c in channel.group_conns.values() if c.closed]:
                    channel.drop_group(c)
                continue
            for c in ready:
                if c is channel.wake:
                    c.recv_bytes()
                    continue
                try:
                    batch: OutputBatch = c.recv()
                except (EOFError, OSError) as e:
                    if c is conn:
                        return f"the engine's driver went away ({type(e).__name__}); reconnecting"
                    channel.drop_group(c)
                    continue
                self._route(batch)

    def _route(self, batch: OutputBatch) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        streams = self._streams
        for delta in batch.rows_for(streams):  # the per-request records of this front end's streams only
            route = streams.get(delta.request_id)
            if route is not None:
                by_loop.setdefault(route[0], []).append((route[1], delta))
        for loop, items in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_deliver, items)

    def _channel_lost(self, reason: str) -> None:
        self._dead = reason  # first, so that a request registering from now on is refused by ``generate``
        log.error("%s; ending the engine side of %d in-flight requests (resumed once it is back)", reason,
                  len(self._streams))
        err = RequestError("unhealthy", reason)
        for rid, (loop, q) in list(self._streams.items()):
            if not loop.is_closed():
                loop.call_soon_threadsafe(q.put_nowait, RequestDelta(rid, [], finished=True, error=err))

    def _reconnect(self) -> bool:
        """Wait for Ray to restart the driver actor (or start a fresh one if Ray gave up on it) and open a new
        channel; retries with back-off until it works or the client shuts down (then returns False)."""
        import ray

        from raymoe.actors.driver_actor import find_driver_actor, start_driver_actor

        delay = 0.5
        while not self._closing:
            try:
                try:
                    ray.get(self.driver.ready.remote(), timeout=self.start_timeout_s)
                except ray.exceptions.ActorDiedError:  # dead for good (restarts exhausted, or killed with no_restart)
                    if self.frontend_id:  # an attached front end waits for the engine's owner to start it again
                        self.driver = find_driver_actor(self.engine_name)
                    else:
                        log.warning("the driver actor is gone; starting a new one")
                        self.driver = start_driver_actor(self.config, name=self.engine_name)
                    ray.get(self.driver.ready.remote(), timeout=self.start_timeout_s)
                conn = self._open_channel()
            except Exception as e:  # noqa: BLE001 - keep trying; health stays false meanwhile
                log.warning("reconnecting to the driver failed (%s); retrying in %.1f s", type(e).__name__, delay)
                time.sleep(delay)
                delay = min(2 * delay, 10.0)
                continue
            with self._send_lock:
                self._conn = conn
            self.reconnects += 1
            self._dead = None
            log.warning("reconnected to the engine's driver")
            return True
        return False

    def _send(self, adds: list[AddRequest], aborts: list[str]) -> None:
        with self._send_lock:
            self._conn.send((adds, aborts))

    # ------------------------------------------------------------------ requests and aborts
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       output_ids: Sequence[int] = (), export_kv: bool = False,
                       kv_received: bool = False, kv_stream: KVStreamTarget | None = None
                       ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas (the last has ``finished=True``). Leaving early aborts the request.

        ``output_ids``, ``export_kv``, ``kv_received``, ``kv_stream``: prefill/decode disaggregation
        (``AddRequest``; ``raymoe.client.pd_client``): the tokens the request has already, keep its prompt KV for a
        decode engine, its prompt KV is in its reservation, write its prompt KV there layer by layer.

        Raises:
            InvalidRequestError: refused by the scheduler (prompt too long, queue full: field ``"queue"`` ...).
            EngineUnhealthyError: the engine failed.
            ValueError: ``request_id`` is already in flight, or holds ``FRONTEND_SEP``.
        """
        if FRONTEND_SEP in request_id:
            raise ValueError(f"request id {request_id!r} holds {FRONTEND_SEP!r} (it separates front-end ids)")
        rid = engine_request_id(self.frontend_id, request_id)
        if rid in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        q: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        req = ResumableRequest(rid, list(prompt_token_ids), params, [int(t) for t in output_ids],
                               export_kv=export_kv, kv_received=kv_received, kv_stream=kv_stream)
        done = False
        try:
            if self._dead is not None:
                raise EngineUnhealthyError(self._dead)
            try:
                self._send([req.add()], [])
            except OSError as e:
                raise EngineUnhealthyError(f"the engine's driver went away ({type(e).__name__})") from e
            while True:
                delta = await q.get()
                if delta.error is not None:
                    if not self._closing and req.may_resume(delta.error, self.config.faults):
                        await self._resume(req, delta.error)
                        continue
                    done = True
                    raise delta.error.to_exception()
                req.delivered(delta)
                done = delta.finished
                yield delta if rid is request_id else dataclasses.replace(delta, request_id=request_id)
                if done:
                    return
        finally:
            del self._streams[rid]
            if not done:  # the caller stopped early (client went away)
                self._abort_now(rid)

    async def _resume(self, req: ResumableRequest, error: RequestError) -> None:
        """Wait until the engine is healthy again and submit ``req`` with the tokens it delivered.

        Raises:
            EngineUnhealthyError: ``error``'s, when the engine did not recover within
                ``FaultConfig.request_resume_timeout_s`` or the client is shutting down.
        """
        if error.kind == "retracted":
            req.retracts += 1
        else:
            req.resumes += 1
        deadline = time.monotonic() + self.config.faults.request_resume_timeout_s
        log.info("resuming request %s after %d tokens (%s)", req.request_id, len(req.output_ids), error.message)
        while not await asyncio.to_thread(self._probe_health):
            if self._closing or time.monotonic() > deadline:
                raise error.to_exception()
            await asyncio.sleep(0.2)
        try:
            self._send([req.add()], [])
        except OSError as e:  # the driver went away again: its reader ends this request, which may resume again
            log.warning("resubmitting request %s failed (%s)", req.request_id, type(e).__name__)
            return
        self.resumed_requests += 1

    def _probe_health(self) -> bool:
        """Whether the engine serves again (the channel is up and the driver healthy); one probe per 0.25 s is
        shared by every resuming request (the others read its answer)."""
        import ray

        with self._probe_lock:
            at, ok = self._probe
            if time.monotonic() - at < 0.25:
                return ok
            try:
                ok = self._dead is None and bool(ray.get(self.driver.healthy.remote(), timeout=10))
            except Exception:  # noqa: BLE001 - the driver actor is gone or busy: not healthy yet
                ok = False
            self._probe = (time.monotonic(), ok)
            return ok

    async def abort(self, request_id: str) -> None:
        """Abort a request and free its KV (client went away); unknown or finished ids are ignored."""
        self._abort_now(engine_request_id(self.frontend_id, request_id))

    def _abort_now(self, rid: str) -> None:
        if self._dead is None:
            try:
                self._send([], [rid])
            except OSError:  # the driver is gone: nothing left to free
                pass

    # ------------------------------------------------------------------ state
    async def _ask_driver(self, method: str):
        """Call one of the driver actor's control methods (``DriverActor.<method>``) and return its answer.

        Raises:
            EngineUnhealthyError: the driver is being reconnected. ray exceptions: the driver actor is gone.
        """
        if self._dead is not None:
            raise EngineUnhealthyError(self._dead)
        return await getattr(self.driver, method).remote()

    async def stats(self) -> EngineStats:
        """Counters and gauges for /metrics, health and the idle invariant (``EngineStats``).

        Raises:
            EngineUnhealthyError: the driver is being reconnected. ray exceptions: the driver actor is gone.
        """
        return await self._ask_driver("stats")

    async def cached_blocks(self) -> list[int]:
        """The block hashes of the prefixes the engine caches (``DriverActor.cached_blocks``; for a prefix-aware
        router in front of several engines).

        Raises:
            EngineUnhealthyError: the driver is being reconnected. ray exceptions: the driver actor is gone.
        """
        return await self._ask_driver("cached_blocks")

    async def rebalance_experts(self) -> bool:
        """Ask the driver for an expert rebalance at its next step (``DriverActor.rebalance_experts``); False when
        the engine was started without ``enable_eplb``.

        Raises:
            EngineUnhealthyError: the driver is being reconnected. ray exceptions: the driver actor is gone.
        """
        return await self._ask_driver("rebalance_experts")

    async def update_weights(self, update: WeightUpdate) -> WeightUpdateResult:
        """Serve ``update``'s weights once the requests in flight are done (``DriverActor.update_weights``;
        requests sent meanwhile wait); returns how it ended.

        Raises:
            EngineUnhealthyError: the driver is being reconnected. ray exceptions: the driver actor is gone.
        """
        if self._dead is not None:
            raise EngineUnhealthyError(self._dead)
        return await self.driver.update_weights.remote(update)

    async def healthy(self) -> bool:
        """False while a rank failure is being recovered, while the driver loop or actor is down or being
        reconnected, and after shutdown."""
        if self._dead is not None or self._closing:
            return False
        try:
            return await self.driver.healthy.remote()
        except Exception:  # noqa: BLE001 - the driver actor itself is gone
            return False

    async def health_detail(self) -> str:
        """Why the engine is unhealthy, or ``""``."""
        if self._closing:
            return "the engine is shut down"
        if self._dead is not None:
            return self._dead
        try:
            return (await self.driver.stats.remote()).health_detail
        except Exception as e:  # noqa: BLE001
            return f"the engine's driver cannot be reached ({type(e).__name__})"

    def shutdown(self) -> None:
        """Stop the driver loop and the ranks, then the driver actor, and close the channel. An attached front end
        (:meth:`attach`) closes its channel only: the engine aborts its in-flight requests and serves the others."""
        import ray

        self._closing = True
        if self.frontend_id:
            if self._channel is not None:
                self._channel.close()
            return
        try:
            ray.get(self.driver.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.driver)
            if self._channel is not None:
                self._channel.close()
