"""The Ray Serve layout with several engines behind one front end: an ingress deployment (the OpenAI app: parsing,
chat template, tokenization, detokenization, SSE) and an engine deployment of ``engine_replicas`` replicas, each
one whole engine (its driver actor and ranks), called through a deployment handle whose request router sends each
request to the engine that caches the longest prefix of its prompt (``raymoe.deploy.serve_router``).

This is the split Ray Serve LLM also makes (an OpenAI ingress in front of LLM server deployments), for the same
reason: Serve's router can only route by content it sees, and behind the HTTP proxy a replica that is its own
ingress gets the body after it was chosen. Here the ingress tokenizes, so the router sees token ids.

What crosses the handle per request: the prompt's token ids and ``SamplingParams`` one way, a stream of
``RequestDelta`` records (the engine's own output rows) back. A client that goes away cancels the stream, and the
engine replica's ``EngineClient.generate`` aborts the request and frees its KV. Engine faults are handled inside
each replica (``EngineClient``: requests resume after a rank or driver fault); a replica that dies fails its
streams, and Serve replaces it.

Limits of this layout: ``/metrics`` of the ingress carries the front end's families only (each engine replica's
gauges would mix if one scrape read one replica and the next another), and ``/admin`` calls reach one replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

from ray import serve

from raymoe.actors.records import RequestDelta
from raymoe.config import ModelConfig
from raymoe.deploy.server_config import ServeOptions
from raymoe.errors import EngineUnhealthyError
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.tokenizer import load_tokenizer

# Seconds between the replicas' reports of their cached prefixes to the routers (Serve's default is 10 s; a report
# is one list of block hashes, 8 bytes per 16 cached tokens).
ROUTING_STATS_PERIOD_S = 1.0


async def check_engine_health(engine) -> None:
    """Raise unless ``engine`` (an ``EngineClient``) is healthy: its driver actor answers, its step loop is alive
    and not stalled, and its ranks are up.

    Raises:
        RuntimeError: the engine is unhealthy or did not answer within 20 s (the message says why).
    """
    try:
        ok = await asyncio.wait_for(engine.healthy(), timeout=20.0)
    except asyncio.TimeoutError:
        raise RuntimeError("the raymoe engine did not answer its health check within 20 s") from None
    if not ok:
        detail = await asyncio.wait_for(engine.health_detail(), timeout=20.0)
        raise RuntimeError(f"the raymoe engine is unhealthy: {detail or 'unknown reason'}")


class RaymoeEngine:
    """One engine replica: an ``EngineClient`` (driver actor and ranks) serving token ids through a handle.

    Args:
        options: ``ServeOptions`` fields (a plain dict).
    """

    def __init__(self, options: dict):
        self.options = ServeOptions(**options)
        self.engine = self.options.engine_client(progress=False)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas (``EngineClient.generate``; the router reads ``prompt_token_ids``).

        Raises:
            InvalidRequestError, EngineUnhealthyError: as ``EngineClient.generate``.
        """
        async for delta in self.engine.generate(request_id, prompt_token_ids, params):
            yield delta

    async def record_routing_stats(self) -> dict:
        """For the request router: the block hashes of every prefix this engine caches, and this replica's clock
        (seconds since the epoch) when they were read."""
        at = time.time()
        return {"blocks": await self.engine.cached_blocks(), "at": at}

    async def stats(self):
        return await self.engine.stats()

    async def healthy(self) -> bool:
        return await self.engine.healthy()

    async def health_detail(self) -> str:
        return await self.engine.health_detail()

    async def rebalance_experts(self) -> bool:
        return await self.engine.rebalance_experts()

    async def check_health(self) -> None:
        """Serve's health check (``check_engine_health``)."""
        await check_engine_health(self.engine)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class RemoteEngine:
    """The engine interface the OpenAI app uses (``EngineClient``'s), over a handle to the engine replicas.

    Args:
        options: the serve options (model, limits, engine options). handle: the ``RaymoeEngine`` deployment's
            handle. replicas: how many engine replicas serve behind it.
    """

    def __init__(self, options: ServeOptions, handle, replicas: int):
        model = options.resolved_model(progress=False)
        self.config = options.engine_config(model)
        self.model_config = ModelConfig.from_hf(model)
        self.model_name = options.served_model_name or Path(model).name
        self.tokenizer = load_tokenizer(model)
        self.handle = handle
        self.replicas = replicas

    @property
    def max_context_len(self) -> int:
        """Longest prompt + output the engines accept, tokens."""
        return min(self.config.cache.max_context_len, self.model_config.max_position_embeddings)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas from the engine replica the router picks; leaving early cancels the stream
        (the replica aborts the request)."""
        stream = self.handle.options(stream=True).generate.remote(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params)
        finished = False
        try:
            async for delta in stream:
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                stream.cancel()

    async def abort(self, request_id: str) -> None:
        """Nothing to send: a stream the app stops reading is cancelled by :meth:`generate`'s exit."""

    async def stats(self):
        """Not exported in this layout (module docstring).

        Raises:
            EngineUnhealthyError: always; the app's ``/metrics`` then carries the front end's families only.
        """
        raise EngineUnhealthyError("engine stats are per replica in the split Serve layout")

    async def healthy(self) -> bool:
        """Whether the engine replica the handle reaches is healthy."""
        try:
            return bool(await self.handle.healthy.remote())
        except Exception:  # noqa: BLE001 - no replica answers
            return False

    async def health_detail(self) -> str:
        try:
            return await self.handle.health_detail.remote()
        except Exception as e:  # noqa: BLE001
            return f"no engine replica answers ({type(e).__name__})"

    async def rebalance_experts(self) -> bool:
        return await self.handle.rebalance_experts.remote()

    def shutdown(self) -> None:
        """Nothing to stop here: Serve stops the engine replicas."""


class RaymoeIngress:
    """The OpenAI app in front of the engine replicas.

    Args:
        options: ``ServeOptions`` fields. engine: the ``RaymoeEngine`` deployment (bound; Serve passes its handle).
        replicas: the engine deployment's replica count.
    """

    def __init__(self, options: dict, engine, replicas: int):
        self.options = ServeOptions(**options)
        self.engine = RemoteEngine(self.options, engine, replicas)

    def __serve_build_asgi_app__(self):
        from raymoe.deploy.openai_api import build_openai_app

        sched, dp = self.engine.config.scheduler, self.engine.config.parallel.dp_size
        max_in_flight = self.options.max_in_flight or (
            self.engine.replicas * dp * (sched.max_running_requests + sched.max_queued_requests))
        return build_openai_app(self.engine, api_key=self.options.api_key, max_in_flight=max_in_flight,
                                limits=self.options.limits, reasoning_parser=self.options.reasoning_parser,
                                tool_call_parser=self.options.tool_call_parser)

    async def check_health(self) -> None:
        """Raise unless some engine replica answers healthy.

        Raises:
            RuntimeError: none does.
        """
        if not await self.engine.healthy():
            raise RuntimeError(f"no healthy raymoe engine replica: {await self.engine.health_detail()}")


def engine_deployments(options: ServeOptions, replicas: int, router: str, deployment_options: dict):
    """The split layout as a Serve application: ``RaymoeIngress`` bound to ``replicas`` ``RaymoeEngine`` replicas
    whose handle routes with ``router`` (``"prefix_aware"``: ``PrefixAwareRequestRouter``; ``"power_of_two"``:
    Serve's default). ``deployment_options``: the stop and health options both deployments share."""
    from ray.serve.config import RequestRouterConfig

    from raymoe.deploy.serve_router import PrefixAwareRequestRouter

    config = RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    if router == "prefix_aware":
        config = RequestRouterConfig(request_router_class=PrefixAwareRequestRouter,
                                     request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    engine = serve.deployment(RaymoeEngine, name="raymoe-engine", num_replicas=replicas,
                              request_router_config=config, **deployment_options)
    ingress = serve.deployment(serve.ingress()(RaymoeIngress), name="raymoe", **deployment_options)
    values = options.model_dump()
    return ingress.bind(values, engine.bind(values), replicas)
