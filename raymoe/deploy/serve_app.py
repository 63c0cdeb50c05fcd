"""Ray Serve application: the same OpenAI API as ``raymoe serve``, deployed with ``serve run configs/serve.yaml``.

``build_app(args)`` is the application builder named by the config's ``import_path``; ``args`` are
:class:`~raymoe.deploy.server_config.ServeOptions` fields, validated when the app is built. Each replica of
:class:`RaymoeDeployment` starts one engine: an ``EngineClient`` whose driver actor owns the rank actors (one
STRICT_PACK placement group per TP group, GPU bundles when the cluster has GPUs), and serves the FastAPI app of
``openai_api`` over it. A replica whose driver actor died fails its health check, and Serve replaces it (which
starts a fresh driver and ranks); a rank failure alone is recovered by the driver itself.
"""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve import Application

from raymoe.deploy.server_config import ServeOptions


@serve.deployment(name="raymoe", max_ongoing_requests=512, health_check_period_s=10.0,
                  health_check_timeout_s=30.0, ray_actor_options={"num_cpus": 1})
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
                               limits=self.options.limits)
        freeze_startup_heap()  # the replica's process is ours: no full-heap GC pause under the streams
        return app

    async def check_health(self) -> None:
        """Raise unless the engine is healthy: its driver actor answers (a dead one is being restarted and
        reconnected), its step loop is alive and not stalled, and its ranks are up. Serve replaces a replica
        after several failed checks in a row, which outlasts a rank-group or driver restart of a small model.

        Raises:
            RuntimeError: the engine is unhealthy (the message says why).
        """
        try:
            ok = await asyncio.wait_for(self.engine.healthy(), timeout=20.0)
        except asyncio.TimeoutError:
            raise RuntimeError("the raymoe engine did not answer its health check within 20 s") from None
        if not ok:
            detail = await asyncio.wait_for(self.engine.health_detail(), timeout=20.0)
            raise RuntimeError(f"the raymoe engine is unhealthy: {detail or 'unknown reason'}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_app(args: dict | None = None) -> Application:
    """Application builder for Ray Serve (``import_path: raymoe.deploy.serve_app:build_app``).

    Raises:
        pydantic.ValidationError: an unknown or out-of-range argument (before any replica starts).
    """
    options = ServeOptions(**(args or {}))
    return RaymoeDeployment.bind(options.model_dump())
