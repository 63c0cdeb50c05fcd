"""BlockingClient: blocking calls over an asyncio engine client, for the offline ``Engine`` API.

The clients of driver actors (``EngineClient``, ``PDEngineClient``) stream each request's deltas as an async
iterator and schedule their clean-ups (a PD request's reservation and export release) as tasks of the event loop
the request ran on. ``Engine.generate`` is a blocking call, so its requests run on an event loop of their own, in a
daemon thread that lives as long as the client: a clean-up task a request left behind finishes there after
``generate`` returned, which a loop created per call (``asyncio.run``) would cancel at its end.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from raymoe.actors.records import RequestDelta
from raymoe.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class StreamRequest:
    """One request of a blocking batch: its id, prompt token ids and validated sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class BlockingClient:
    """Run requests on an async engine client from blocking code (module docstring).

    Args:
        client: an object with ``async generate(request_id, prompt_token_ids, params)`` yielding ``RequestDelta``s
            and ``shutdown()`` (``EngineClient``, ``PDEngineClient``).
    """

    def __init__(self, client):
        self.client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="raymoe-engine-loop", daemon=True)
        self._thread.start()

    def generate(self, requests: list[StreamRequest]) -> list[list[RequestDelta]]:
        """Run every request concurrently (the engines batch them) and return each one's deltas, in input order.

        Raises:
            Whatever the client raises for a request (``InvalidRequestError`` naming the field,
            ``EngineUnhealthyError``): the first such error, after every other request of the call was aborted.
        """
        return asyncio.run_coroutine_threadsafe(self._all(requests), self._loop).result()

    async def _all(self, requests: list[StreamRequest]) -> list[list[RequestDelta]]:
        tasks = [asyncio.ensure_future(self._one(r)) for r in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # leaving a stream aborts its request on the engine that holds it
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, r: StreamRequest) -> list[RequestDelta]:
        out = []
        async for delta in self.client.generate(r.request_id, r.prompt_token_ids, r.params):
            out.append(delta)
        return out

    def shutdown(self) -> None:
        """Shut the client down, then stop the loop (clean-up tasks still pending are dropped with the engines)."""
        try:
            self.client.shutdown()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
