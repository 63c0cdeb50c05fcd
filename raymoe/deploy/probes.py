"""Readiness and liveness of the HTTP front end (the answers of ``/ready``, ``/health`` and ``/live``).

Readiness says whether a load balancer should send this server new requests; liveness whether the process needs a
restart. They differ on purpose: while a rank group restarts (weights reload, decode graphs recapture) or while the
server drains for a stop, it must not get new requests, but restarting it would only lose the work in flight.

- ``GET /ready`` (and ``GET /health``, the same answer): 200 ``{"status": "ok"}`` while the engine is healthy and
  the server admits requests; 503 ``{"status": "draining", "error": {... "code": "server_shutdown"}}`` with a
  ``Retry-After`` header once a drain began (``drain.py``), 503 ``{"status": "unhealthy", "error": {... "code":
  "engine_unhealthy"}}`` while the engine is not serving (a rank group restarting, the driver reconnecting, no
  answer within ``ENGINE_PROBE_TIMEOUT_S``).
- ``GET /live``: 200 whenever the event loop answers, with ``"status"`` ``"ok"`` or ``"draining"``.

Before the weights are loaded and the graphs captured the listener of ``raymoe serve`` is not open yet (the engine
starts first), so every probe fails with a refused connection: Kubernetes counts that as unready, and a
``startupProbe`` keeps liveness checks off until the first success. A Ray Serve replica receives no request before
its engine is up (Serve routes only to running replicas) nor once Serve stops it.
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse

from raymoe.client.engine_client import EngineClient
from raymoe.deploy.drain import Drain, shutdown_error
from raymoe.deploy.http_errors import APIError

# How long a probe waits for the driver actor's answer, seconds (a stalled driver counts as unhealthy; Kubernetes'
# default probe timeout is 1 s, so probes of a loaded engine should allow more: the KubeRay manifest sets 5 s).
ENGINE_PROBE_TIMEOUT_S = 4.0


async def readiness(engine: EngineClient, drain: Drain, request_id: str | None = None) -> JSONResponse:
    """The ``/ready`` answer: 200 when new requests are welcome, else 503 saying why (see the module docstring)."""
    if drain.draining:
        body = {"status": "draining", **shutdown_error().body(request_id)}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(drain.config.retry_after_s)})
    try:
        ok = await asyncio.wait_for(engine.healthy(), timeout=ENGINE_PROBE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - an unreachable or slow engine is unhealthy
        ok = False
    if not ok:
        err = APIError(503, "the engine is unhealthy (a rank failed; recovering)", code="engine_unhealthy")
        return JSONResponse({"status": "unhealthy", **err.body(request_id)}, status_code=503)
    return JSONResponse({"status": "ok"})


def liveness(drain: Drain) -> JSONResponse:
    """The ``/live`` answer: always 200 (the process answers), ``"draining"`` during a drain."""
    return JSONResponse({"status": "draining" if drain.draining else "ok"})
