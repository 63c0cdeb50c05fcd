"""How ``raymoe serve`` stops: the first SIGTERM or SIGINT drains, a second one stops at once, a third drops.

uvicorn's own answer to a signal is to close the listener and then cancel every response still open after
``timeout_graceful_shutdown``: streams are cut, and a load balancer sees refused connections instead of an unready
server. :class:`DrainingServer` replaces that first step. On the first signal it starts ``Drain.run`` (``drain.py``)
on the server's event loop while the listener stays open: new API requests get 503 ``server_shutdown`` with
``Retry-After``, ``/health`` and ``/ready`` answer 503 ``draining``, the requests in flight have
``shutdown_timeout_s`` to finish, and what is left ends with a ``server_shutdown`` error event and ``[DONE]``.
Only then does uvicorn close the listener and the connections (all answers are complete by then). A second signal
ends the wait at once (``Drain.hurry``): the requests in flight end with the ``server_shutdown`` event right away
(well under a second, at most ``cut_grace_s`` for a client that does not read). A third sets uvicorn's
``force_exit``: the listener closes and open responses are dropped.

uvicorn re-raises a signal it caught once it has shut down; this server does not, so ``raymoe serve`` goes on to
stop its engine and exits 0 after a drain (1 after a stop hurried by a second signal).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from types import FrameType

import uvicorn

from raymoe.deploy.drain import Drain


def _say(line: str) -> None:
    print(f"raymoe serve: {line}", file=sys.stderr, flush=True)


class _StopNow(Exception):
    """A signal arrived while the engine was stopping gracefully."""


def _raise_stop_now(signum, frame) -> None:
    raise _StopNow(signal.Signals(signum).name)


def _exit_now(signum, frame) -> None:
    _say(f"{signal.Signals(signum).name} while stopping Ray: exiting at once")
    os._exit(1)


def stop_engine(engine, stop_ray: bool) -> None:
    """Stop ``engine`` (its driver actor and ranks, ``EngineClient.shutdown``), then, with ``stop_ray``, the local
    Ray this process started. A signal meanwhile skips the engine's graceful stop: stopping the local Ray kills the
    driver and ranks with it, and on a cluster that was not ours Ray ends them with their owner, this process.
    A signal while Ray stops exits at once."""
    import ray

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_stop_now)
    _say("stopping the engine")
    try:
        engine.shutdown()
    except _StopNow as e:
        _say(f"{e} while stopping the engine: skipping its graceful stop")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_now)
    if stop_ray:
        ray.shutdown()
    _say("stopped")


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose first SIGTERM / SIGINT drains ``drain`` before it stops.

    Args:
        config: uvicorn's config. drain: the app's drain state (``app.state.drain``).

    Attributes:
        report: the ``DrainReport`` once a drain finished (None before, or after a forced stop).
        forced: True when a second signal cut the drain short.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self.report = None
        self.forced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread, between two bytecodes of the event loop's thread): the first signal starts
        the drain on the loop, a second one cuts it short, a third forces the stop. Never re-raised after shutdown
        (unlike uvicorn)."""
        name = signal.Signals(sig).name
        if self._loop is not None and self.drain.draining and not self.forced and self.report is None:
            _say(f"{name} again: ending the {self.drain.in_flight} requests in flight now with a server_shutdown "
                 f"error (a third signal drops them)")
            self.forced = True
            self._loop.call_soon_threadsafe(self.drain.hurry)
            return
        if self.drain.draining or self.should_exit or self._loop is None:
            if not self.force_exit:
                _say(f"{name} again: stopping at once (open responses are dropped)")
            self.forced = self.forced or self.report is None
            self.force_exit = self.should_exit = True
            return
        self.drain.draining = True  # at once: a request arriving before the drain task runs is refused too
        _say(f"{name}: draining {self.drain.in_flight} requests in flight (new requests get 503; shutdown timeout "
             f"{self.drain.config.shutdown_timeout_s:g} s; send the signal again to stop at once)")
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            self.report = await self.drain.run()
            _say(self.report.summary())
        finally:
            self.should_exit = True  # uvicorn closes the listener and the (now idle) connections
