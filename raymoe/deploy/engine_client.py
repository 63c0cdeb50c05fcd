"""EngineClient: what the HTTP layer talks to (streaming generate, abort, stats, health).

Two implementations share the same ``DriverService``:
- :class:`LocalEngineClient` runs the driver loop in this process (world size 1 ranks in-process, larger worlds
  as Ray rank actors started from here);
- :class:`RayEngineClient` talks to a ``DriverActor`` (the driver as a Ray actor; rank actors are its children),
  which is what ``raymoe serve`` and the Ray Serve app use.
The front end tokenizes, applies chat templates and detokenizes; the engine sees token ids only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path

from raymoe.actors.driver_service import DriverService, EngineStats, RequestDelta
from raymoe.actors.factory import build_driver
from raymoe.config import EngineConfig, ModelConfig
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.tokenizer import load_tokenizer


class EngineClient(ABC):
    """Async interface of a running engine.

    Attributes:
        config: the engine configuration. model_config: the normalized model config.
        model_name: name served as the OpenAI ``model`` (folder name unless given). tokenizer: HF tokenizer.
    """

    config: EngineConfig
    model_config: ModelConfig
    model_name: str
    tokenizer: object

    def _init_common(self, config: EngineConfig, model_name: str | None) -> None:
        self.config = config
        self.model_config = ModelConfig.from_hf(config.model)
        self.model_name = model_name or Path(config.model).name
        self.tokenizer = load_tokenizer(config.model)

    @property
    def max_context_len(self) -> int:
        """Longest prompt + output the engine accepts, tokens."""
        return min(self.config.cache.max_context_len, self.model_config.max_position_embeddings)

    @abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas (the last has ``finished=True``).

        Raises:
            InvalidRequestError: refused by the scheduler (prompt too long, queue full ...).
            EngineUnhealthyError: the engine failed.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request and free its KV (client went away)."""

    @abstractmethod
    async def stats(self) -> EngineStats:
        """Counters and gauges for /metrics."""

    @abstractmethod
    async def healthy(self) -> bool:
        """False while a rank failure is being recovered or after shutdown."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the driver loop and the ranks."""


class LocalEngineClient(EngineClient):
    """Driver loop in this process."""

    def __init__(self, config: EngineConfig, model_name: str | None = None):
        self._init_common(config, model_name)
        self.service = DriverService(build_driver(config, self.model_config, self.tokenizer))

    async def generate(self, request_id, prompt_token_ids, params):
        async for delta in self.service.generate(request_id, prompt_token_ids, params):
            yield delta

    async def abort(self, request_id: str) -> None:
        self.service.abort(request_id)

    async def stats(self) -> EngineStats:
        return self.service.stats()

    async def healthy(self) -> bool:
        return self.service.healthy()

    def shutdown(self) -> None:
        self.service.shutdown()
        self.service.driver.executor.shutdown()


class DriverActor:
    """The driver as a Ray actor (``ray.remote(DriverActor)``): owns the DriverService and the rank actors."""

    def __init__(self, config: EngineConfig):
        model_config = ModelConfig.from_hf(config.model)
        self.service = DriverService(build_driver(config, model_config, load_tokenizer(config.model)))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        async for delta in self.service.generate(request_id, prompt_token_ids, params):
            yield delta

    def abort(self, request_id: str) -> None:
        self.service.abort(request_id)

    def stats(self) -> EngineStats:
        return self.service.stats()

    def healthy(self) -> bool:
        return self.service.healthy()

    def ready(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.service.shutdown()
        self.service.driver.executor.shutdown()


class RayEngineClient(EngineClient):
    """Client of a ``DriverActor`` (created here unless ``driver_handle`` is given).

    Args:
        config: engine configuration (ranks and KV sizes).
        model_name: served model name. driver_handle: an existing driver actor to attach to.
        start_timeout_s: how long to wait for the driver and its ranks to come up, seconds.
    """

    def __init__(self, config: EngineConfig, model_name: str | None = None, driver_handle=None,
                 start_timeout_s: float = 600.0):
        import ray

        from raymoe.cluster.bootstrap import init_ray

        self._init_common(config, model_name)
        init_ray(config.ray_address)
        if driver_handle is None:
            driver_handle = ray.remote(DriverActor).options(num_cpus=0, max_concurrency=1000).remote(config)
        self.driver = driver_handle
        ray.get(self.driver.ready.remote(), timeout=start_timeout_s)

    async def generate(self, request_id, prompt_token_ids, params):
        gen = self.driver.generate.options(num_returns="streaming").remote(request_id, prompt_token_ids, params)
        async for ref in gen:
            yield await ref

    async def abort(self, request_id: str) -> None:
        await self.driver.abort.remote(request_id)

    async def stats(self) -> EngineStats:
        return await self.driver.stats.remote()

    async def healthy(self) -> bool:
        try:
            return await self.driver.healthy.remote()
        except Exception:  # noqa: BLE001 - the driver actor itself is gone
            return False

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.driver.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.driver)
