"""EngineClient: the HTTP front end's side of a driver actor (streaming generate, abort, stats, health).

The engine's step loop never runs in the HTTP process: it lives in a :class:`~raymoe.actors.driver_actor.DriverActor`
(its own process, also for a single rank). The client keeps the traffic between the two to a few messages per
step, whatever the number of requests:

* one long-lived output stream (``DriverActor.outputs``) whose messages each carry the deltas of every request
  that advanced in one step; a pump task routes them to per-request asyncio queues;
* new requests and aborts are gathered while the previous ``submit`` call is in flight and sent together in the
  next one (so they also reach the driver in the order they were made).

The front end tokenizes, applies chat templates, detokenizes and writes SSE; the engine sees token ids only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from raymoe.actors.driver_service import AddRequest, EngineStats, RequestDelta, RequestError
from raymoe.config import EngineConfig, ModelConfig
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class EngineClient:
    """Client of a ``DriverActor`` (created here unless ``driver_handle`` is given).

    Args:
        config: engine configuration (ranks and KV sizes).
        model_name: served model name (default: the folder name). driver_handle: an existing driver actor.
        start_timeout_s: how long to wait for the driver and its ranks to come up, seconds.

    Attributes:
        config, model_config (normalized), model_name, tokenizer (the model's Hugging Face tokenizer).

    Raises:
        ray.exceptions.GetTimeoutError / RayActorError: the driver or its ranks did not start.
    """

    def __init__(self, config: EngineConfig, model_name: str | None = None, driver_handle=None,
                 start_timeout_s: float = 600.0):
        import ray

        from raymoe.actors.driver_actor import start_driver_actor
        from raymoe.cluster.bootstrap import init_ray

        self.config = config
        self.model_config = ModelConfig.from_hf(config.model)
        self.model_name = model_name or Path(config.model).name
        self.tokenizer = load_tokenizer(config.model)
        init_ray(config.ray_address)
        if driver_handle is None:
            driver_handle = start_driver_actor(config)
        self.driver = driver_handle
        ray.get(self.driver.ready.remote(), timeout=start_timeout_s)
        self._streams: dict[str, asyncio.Queue[RequestDelta]] = {}
        self._adds: list[AddRequest] = []
        self._aborts: list[str] = []
        self._sender: asyncio.Task | None = None
        self._pump: asyncio.Task | None = None

    @property
    def max_context_len(self) -> int:
        """Longest prompt + output the engine accepts, tokens."""
        return min(self.config.cache.max_context_len, self.model_config.max_position_embeddings)

    # ------------------------------------------------------------------ output stream
    def _ensure_pump(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pump is None or self._pump.done() or self._pump.get_loop() is not loop:
            self._pump = loop.create_task(self._run_pump(), name="raymoe-output-pump")

    async def _run_pump(self) -> None:
        try:
            async for ref in self.driver.outputs.options(num_returns="streaming").remote():
                for delta in await ref:
                    q = self._streams.get(delta.request_id)
                    if q is not None:
                        q.put_nowait(delta)
            reason = "the driver closed its output stream"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the driver actor died or the stream broke
            reason = f"the engine's driver failed: {type(e).__name__}: {e}"
        log.error("%s; failing %d in-flight requests", reason, len(self._streams))
        err = RequestError("unhealthy", reason)
        for rid, q in list(self._streams.items()):
            q.put_nowait(RequestDelta(rid, [], finished=True, error=err))

    # ------------------------------------------------------------------ requests and aborts
    def _send_soon(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send(), name="raymoe-submit")

    async def _send(self) -> None:
        while self._adds or self._aborts:
            adds, aborts, self._adds, self._aborts = self._adds, self._aborts, [], []
            try:
                await self.driver.submit.remote(adds, aborts)
            except Exception as e:  # noqa: BLE001 - the driver is gone: fail the requests that were not handed over
                err = RequestError("unhealthy", f"the engine's driver failed: {type(e).__name__}: {e}")
                for a in adds:
                    if (q := self._streams.get(a.request_id)) is not None:
                        q.put_nowait(RequestDelta(a.request_id, [], finished=True, error=err))

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas (the last has ``finished=True``). Leaving early aborts the request.

        Raises:
            InvalidRequestError: refused by the scheduler (prompt too long, queue full: field ``"queue"`` ...).
            EngineUnhealthyError: the engine failed.
        """
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._ensure_pump()
        q: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._streams[request_id] = q
        self._adds.append(AddRequest(request_id, list(prompt_token_ids), params))
        self._send_soon()
        done = False
        try:
            while True:
                delta = await q.get()
                if delta.error is not None:
                    done = True
                    raise delta.error.to_exception()
                done = delta.finished
                yield delta
                if done:
                    return
        finally:
            del self._streams[request_id]
            if not done:  # the caller stopped early (client went away)
                self._aborts.append(request_id)
                self._send_soon()

    async def abort(self, request_id: str) -> None:
        """Abort a request and free its KV (client went away); unknown or finished ids are ignored."""
        self._aborts.append(request_id)
        self._send_soon()

    # ------------------------------------------------------------------ state
    async def stats(self) -> EngineStats:
        """Counters and gauges for /metrics."""
        return await self.driver.stats.remote()

    async def healthy(self) -> bool:
        """False while a rank failure is being recovered, after shutdown, or when the driver is gone."""
        try:
            return await self.driver.healthy.remote()
        except Exception:  # noqa: BLE001 - the driver actor itself is gone
            return False

    def shutdown(self) -> None:
        """Stop the driver loop and the ranks, then the driver actor."""
        import ray

        try:
            ray.get(self.driver.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.driver)
