"""Operator routes of the HTTP server (``/admin/*``), included by ``openai_api.build_openai_app`` (so ``raymoe serve``
and the Ray Serve app both have them):

- ``GET /admin/expert_load``: the engine's expert-load window as JSON (``ExpertLoadReport.to_json``: the file
  ``raymoe eplb dump`` writes and ``init_expert_location`` reads back); 404 when the engine records no expert load
  (``enable_expert_distribution_metrics`` and ``enable_eplb`` off).
- ``POST /admin/rebalance_experts``: ask the driver for an expert rebalance at its next step (``raymoe.eplb.
  controller``: it waits until the window holds ``eplb_min_window_tokens`` per layer); ``{"requested": true}``, or
  400 when the engine runs without ``enable_eplb``.

With an API key set these routes need ``Authorization: Bearer KEY`` like ``/v1/*``: the same check and the same
401 body as ``http_guard`` (the guard itself protects ``/v1/*`` only), before the handler runs. Errors are the
OpenAI-style bodies of ``http_errors``; an engine that does not answer within ``ADMIN_ENGINE_TIMEOUT_S`` is a 503.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from ray.exceptions import RayError

from raymoe.client.engine_client import EngineClient
from raymoe.deploy.http_errors import APIError
from raymoe.deploy.http_guard import _auth_error
from raymoe.deploy.protocol import ErrorResponse
from raymoe.errors import EngineUnhealthyError

# How long an admin route waits for the driver actor's answer, seconds (as ``/metrics`` does).
ADMIN_ENGINE_TIMEOUT_S = 10.0

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}


def engine_unavailable() -> APIError:
    """The 503 of an operator route whose engine is recovering or gone."""
    return APIError(503, "the engine is unavailable (recovering from a failure); retry later", code="engine_unhealthy")


async def ask_engine(call):
    """Await the engine call ``call`` within ``ADMIN_ENGINE_TIMEOUT_S``.

    Raises:
        APIError: 503 when the engine is unhealthy, gone or does not answer in time.
    """
    try:
        return await asyncio.wait_for(call, timeout=ADMIN_ENGINE_TIMEOUT_S)
    except (EngineUnhealthyError, RayError, asyncio.TimeoutError):  # RayError: the driver actor is gone
        raise engine_unavailable() from None


def api_key_check(api_key: str | None):
    """A FastAPI dependency that refuses a request without ``Authorization: Bearer api_key`` (401, the body of
    ``http_guard``; None: every request passes): for operator routes outside ``/v1/*``."""

    async def authorized(request: Request) -> None:
        if api_key is not None and (err := _auth_error(request.headers, api_key)) is not None:
            raise err

    return Depends(authorized)


def admin_router(engine: EngineClient, api_key: str | None) -> APIRouter:
    """The ``/admin`` routes over ``engine`` (module docstring); ``api_key``: the bearer token they need (None:
    open, as ``/v1/*``)."""
    router = APIRouter(prefix="/admin", dependencies=[api_key_check(api_key)], responses=_ERRORS)

    @router.get("/expert_load")
    async def expert_load() -> dict:
        """The expert-load window: per MoE layer and logical expert the routed (token, expert) pairs
        (``expert_load``, [layers][experts]), the per-layer balance, the placement the ranks hold and the rebalance
        counters; ``raymoe eplb dump`` writes it to a file that ``init_expert_location`` accepts."""
        stats = await ask_engine(engine.stats())
        if stats.expert_load is None:
            raise APIError(404, "the engine records no expert load; start it with enable_expert_distribution_metrics "
                                "(--enable-expert-distribution-metrics) or enable_eplb (--enable-eplb)",
                           param="enable_expert_distribution_metrics", code="expert_load_not_recorded")
        return stats.expert_load.to_json()

    @router.post("/rebalance_experts")
    async def rebalance_experts() -> dict:
        """Ask for an expert rebalance at the driver's next step (it runs once the load window holds
        ``eplb_min_window_tokens`` routed pairs per layer; weights move in the background, layer by layer)."""
        if not await ask_engine(engine.rebalance_experts()):
            raise APIError(400, "the engine does not rebalance experts; start it with enable_eplb (--enable-eplb)",
                           param="enable_eplb", code="eplb_disabled")
        return {"requested": True}

    return router
