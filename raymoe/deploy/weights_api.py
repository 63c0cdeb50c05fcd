"""``POST /update_weights_from_disk`` and ``GET /get_weight_version``: a reinforcement-learning loop switches the
served weights to the checkpoint its trainer just wrote, and reads which weights serve (SGLang's routes, which verl
and slime call; ``raymoe.actors.weight_update`` does the work).

The folder is read by every rank, so on a cluster it must be on storage every rank's node sees, under the same
path. The update waits for the requests in flight (or aborts them, ``abort_all_requests``, or retracts them,
``retract_requests``: their streams pause and go on with the new weights) while new ones wait, and answers once the
new weights serve: 200 ``{"success": true, "message", "weight_version", "num_aborted_requests",
"num_retracted_requests", "seconds"}``. A folder of another architecture, one that does not load (the ranks then
serve the previous weights again) or requests still running at ``timeout_s`` is a 400 naming the field; another
update in progress or an engine in recovery a 409; a deployment of two engines (prefill/decode) or of engine
replicas a 501 (each engine's server is updated on its own). Both routes need the API key like ``/admin/*``.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationError
from ray.exceptions import RayError

from raymoe.actors.weight_update import WeightUpdate, WeightUpdateResult
from raymoe.client.engine_client import EngineClient
from raymoe.deploy.admin import api_key_check, ask_engine, engine_unavailable
from raymoe.deploy.body_parse import schema_refusal
from raymoe.deploy.http_errors import APIError
from raymoe.deploy.protocol import _STRICT, ErrorResponse
from raymoe.deploy.request_body import body_schema, read_body
from raymoe.errors import EngineUnhealthyError

# The longest a weight update may wait for the requests in flight, seconds (its ``timeout_s``).
MAX_UPDATE_WAIT_S = 3600.0


class UpdateWeightsFromDiskRequest(BaseModel):
    """Body of ``POST /update_weights_from_disk`` (SGLang's fields; ``flush_cache`` and ``load_format`` are
    accepted only with the values raymoe always uses)."""

    model_config = _STRICT

    model_path: str = Field(min_length=1, max_length=4096,
                            description="a model folder of the served architecture, seen by every rank's node")
    weight_version: str | None = Field(None, min_length=1, max_length=256,
                                       description="the name the new weights are reported under (None: kept)")
    abort_all_requests: bool = Field(False, description="abort the requests in flight instead of waiting for them")
    retract_requests: bool = Field(False, description="raymoe's: retract the requests in flight instead; their "
                                   "streams pause and go on with the new weights")
    timeout_s: float = Field(300.0, gt=0, le=MAX_UPDATE_WAIT_S,
                             description="how long to wait for the requests in flight, seconds")
    flush_cache: Literal[True] = Field(True, description="the radix cache is always flushed")
    load_format: Literal["auto"] | None = Field(None, description="the folder's safetensors, as at start-up")


def _answer(result: WeightUpdateResult) -> dict:
    if result.success:
        return {"success": True, "message": result.message, "weight_version": result.weight_version,
                "num_aborted_requests": result.num_aborted_requests,
                "num_retracted_requests": result.num_retracted_requests, "seconds": round(result.seconds, 3)}
    if result.param is not None:
        raise APIError(400, result.message, param=result.param, code="weight_update_failed")
    raise APIError(409, result.message, code="weight_update_refused")


def weights_router(engine: EngineClient, api_key: str | None, max_body_bytes: int) -> APIRouter:
    """The weight routes over ``engine`` (module docstring); ``api_key``: the bearer token they need (None: open).
    ``max_body_bytes``: the server's body limit."""
    router = APIRouter(dependencies=[api_key_check(api_key)],
                       responses={code: {"model": ErrorResponse} for code in (400, 401, 409, 501, 503)})

    @router.post("/update_weights_from_disk", openapi_extra=body_schema(UpdateWeightsFromDiskRequest))
    async def update_weights_from_disk(request: Request) -> dict:
        """Serve another checkpoint folder's weights once the requests in flight are done (module docstring)."""
        body = b"".join(await read_body(request, max_body_bytes))
        try:
            req = UpdateWeightsFromDiskRequest.model_validate_json(body)
        except ValidationError as e:
            r = schema_refusal(e)
            raise APIError(r.status, r.message, param=r.param, code=r.code) from None
        update_fn = getattr(engine, "update_weights", None)
        if update_fn is None:  # two engines (PD) or replicas behind a router: each would have to switch with the rest
            raise APIError(501, "weight updates are not supported by this deployment (prefill/decode "
                                "disaggregation or several engine replicas); update each engine's server",
                           code="unsupported")
        if req.abort_all_requests and req.retract_requests:
            raise APIError(400, "abort_all_requests and retract_requests: the requests in flight are either aborted "
                                "or retracted", param="retract_requests", code="invalid_value")
        update = WeightUpdate(req.model_path, req.weight_version, req.abort_all_requests, req.timeout_s,
                              req.retract_requests)
        try:
            result = await update_fn(update)
        except (EngineUnhealthyError, RayError):  # RayError: the driver actor is gone
            raise engine_unavailable() from None
        return _answer(result)

    @router.get("/get_weight_version")
    async def get_weight_version() -> dict:
        """The name of the weights serving: ``"default"`` until an update named one."""
        return {"weight_version": (await ask_engine(engine.stats())).weight_version}

    return router
