"""Ray Serve application: the same OpenAI API as ``raymoe serve``, deployed with ``serve run configs/serve.yaml``.

``build_app(args)`` is the application builder named by the config's ``import_path``; ``args`` are
:class:`~raymoe.deploy.server_config.ServeOptions` fields, validated when the app is built. Each replica of
:class:`RaymoeDeployment` starts one engine: an ``EngineClient`` whose driver actor owns the rank actors (one
STRICT_PACK placement group per TP group, GPU bundles when the cluster has GPUs), and serves the FastAPI app of
``openai_api`` over it. A replica whose driver actor died fails its health check, and Serve replaces it (which
starts a fresh driver and ranks); a rank failure alone is recovered by the driver itself.

Stops and rolling updates keep streams whole. A redeploy with changed args (``serve deploy`` of an edited config)
starts the replacement replica first (``max_surge_percent=100``: Serve holds the old one running until the new one
is up, so there is no moment without a replica); then Serve stops routing to the old replica and waits until its
ongoing requests, streams included, have finished (checked every ``graceful_shutdown_wait_loop_s``) before it calls
``__del__`` (engine shutdown); after ``graceful_shutdown_timeout_s`` it kills the replica whatever is left.

With ``engine_replicas`` (``ServeLayout``) the app is laid out differently: an ingress deployment with the OpenAI
app in front of that many engine replicas, routed by cached prefix (``raymoe.deploy.serve_engines``).
Serve gives a replica no notice of its drain, so unlike ``raymoe serve`` a stream still running at that point is
cut, not ended with a ``server_shutdown`` event: the timeout is sized for long streams.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from raymoe.deploy.serve_engines import check_engine_health, engine_deployments
from raymoe.deploy.server_config import ServeOptions

# How long Serve lets a stopping replica finish its streams before it kills it, seconds: a 4096-token answer at
# 50 ms per token takes 205 s, plus its time in the queue. Pods must outlive it (terminationGracePeriodSeconds of
# configs/kuberay-rayservice.yaml: this plus 30 s for the engine's own stop).
GRACEFUL_SHUTDOWN_TIMEOUT_S = 300.0
# How often a stopping replica counts its ongoing requests, seconds: it stops (and frees its GPUs) at most this long
# after its last stream ends (Serve's default is 2 s).
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 1.0
# Replacements a rolling update may start before the old replicas stop, percent of the target replica count: 100
# starts each replacement before its old replica stops (Serve's default, 0, stops first: no replica for as long as
# an engine takes to load). The price: room for one more engine (its GPUs) during the update.
MAX_SURGE_PERCENT = 100


DEPLOYMENT_OPTIONS = dict(max_ongoing_requests=512, health_check_period_s=10.0, health_check_timeout_s=30.0,
                          graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
                          graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
                          max_surge_percent=MAX_SURGE_PERCENT, ray_actor_options={"num_cpus": 1})
"""The stop, update and health options of every raymoe deployment (both layouts)."""


class ServeLayout(BaseModel):
    """How the Serve application is laid out (``build_app`` arguments besides the ``ServeOptions``)."""

    model_config = ConfigDict(extra="forbid")

    engine_replicas: int | None = Field(
        None, ge=1, description="None: each Serve replica is a front end with its own engine (scale with Serve's "
                                "num_replicas). N: one front-end deployment calling N engine replicas through a "
                                "handle whose router picks the engine by cached prefix (raymoe.deploy.serve_engines).")
    replica_router: Literal["prefix_aware", "power_of_two"] = Field(
        "prefix_aware", description="with engine_replicas: the engine handle's request router (prefix_aware: "
                                    "raymoe.deploy.serve_router; power_of_two: Serve's default, load only).")


@serve.deployment(name="raymoe", **DEPLOYMENT_OPTIONS)
@serve.ingress()
class RaymoeDeployment:
    """One engine behind the OpenAI API.

    Args:
        options: ``ServeOptions`` fields (a plain dict, so the deployment is serializable).
    """

    def __init__(self, options: dict):
        self.options = ServeOptions(**options)
        self.engine = self.options.engine_client(progress=False)

    def __serve_build_asgi_app__(self):
        from raymoe.actors.process_tuning import freeze_startup_heap
        from raymoe.deploy.openai_api import build_openai_app

        app = build_openai_app(self.engine, api_key=self.options.api_key, max_in_flight=self.options.max_in_flight,
                               limits=self.options.limits, reasoning_parser=self.options.reasoning_parser,
                               tool_call_parser=self.options.tool_call_parser)
        freeze_startup_heap()  # the replica's process is ours: no full-heap GC pause under the streams
        return app

    async def check_health(self) -> None:
        """Raise unless the engine is healthy: its driver actor answers (a dead one is being restarted and
        reconnected), its step loop is alive and not stalled, and its ranks are up. Serve replaces a replica
        after several failed checks in a row, which outlasts a rank-group or driver restart of a small model.

        Raises:
            RuntimeError: the engine is unhealthy (the message says why).
        """
        await check_engine_health(self.engine)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_app(args: dict | None = None) -> Application:
    """Application builder for Ray Serve (``import_path: raymoe.deploy.serve_app:build_app``).

    ``args``: ``ServeOptions`` fields plus the ``ServeLayout`` fields (``engine_replicas``, ``replica_router``).

    Raises:
        pydantic.ValidationError: an unknown or out-of-range argument (before any replica starts).
    """
    args = dict(args or {})
    layout = ServeLayout(**{k: args.pop(k) for k in list(args) if k in ServeLayout.model_fields})
    options = ServeOptions(**args)
    if layout.engine_replicas is not None:
        return engine_deployments(options, layout.engine_replicas, layout.replica_router, DEPLOYMENT_OPTIONS)
    return RaymoeDeployment.bind(options.model_dump())
