"""Options of a serving deployment, shared by ``raymoe serve`` and the Ray Serve app (``serve_app.build_app``).

:class:`ServeOptions` is a pydantic model so the ``args`` of a Serve config file are validated with clear errors;
:meth:`ServeOptions.engine_config` turns it into the engine's frozen ``EngineConfig`` (through the same option
mapping as ``Engine(model, **options)``). Defaults are the main job: two DP-attention groups of one rank each,
experts sharded over both (``ep_size`` = world size), two-batch overlap on (whenever ``ep_size > 1``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from raymoe.config import EngineConfig
from raymoe.errors import InvalidRequestError
from raymoe.scheduler.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

# Longest per-request deadline a client may ask for (``timeout`` field), seconds; also the schema's bound.
MAX_REQUEST_TIMEOUT_S = 86_400.0


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP request may ask of the server; README "Limits and failure behaviour" lists what a client
    sees when each is hit.

    Attributes:
        max_body_bytes: largest request body, bytes; larger ones get 413 before they are parsed (also chunked
            bodies without a Content-Length).
        max_stop_strings: stop strings per request (400 ``param="stop"`` beyond). At most the engine's cap
            ``MAX_STOP_STRINGS``.
        max_stop_string_chars: characters per stop string (400 ``param="stop"`` beyond). At most the engine's
            cap ``MAX_STOP_STRING_CHARS``.
        default_timeout_s: deadline of a request that sends no ``timeout``, seconds from its arrival.
        max_timeout_s: largest ``timeout`` a request may send, seconds (400 ``param="timeout"`` beyond).
        max_stream_backlog_events: SSE events of one stream produced but not yet written to its socket; past it
            the client is reading too slowly: the request is aborted and the stream ends with an error event.
        max_stream_backlog_bytes: the same bound in bytes of those events.
        stream_backlog_grace_s: how long a stream's backlog may stay at its bound before the reader counts as
            slow, seconds (absorbs scheduling jitter: several engine steps can arrive at once).
        stream_drain_timeout_s: once a stream's generation has ended (finished, timed out or aborted), how long
            its remaining events may take to reach a slow reader before the connection is closed, seconds.

    Raises:
        InvalidRequestError: naming the field that is out of range.
    """

    max_body_bytes: int = 16 * 2**20
    max_stop_strings: int = 64
    max_stop_string_chars: int = 512
    default_timeout_s: float = 600.0
    max_timeout_s: float = 3600.0
    max_stream_backlog_events: int = 512
    max_stream_backlog_bytes: int = 2**20
    stream_backlog_grace_s: float = 1.0
    stream_drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name, low in (("max_body_bytes", 1), ("max_stop_strings", 0), ("max_stop_string_chars", 1),
                          ("max_stream_backlog_events", 1), ("max_stream_backlog_bytes", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InvalidRequestError(name, f"must be an integer >= {low}, got {v!r}")
        if self.max_stop_strings > MAX_STOP_STRINGS:
            raise InvalidRequestError("max_stop_strings", f"the engine accepts at most {MAX_STOP_STRINGS}")
        if self.max_stop_string_chars > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError("max_stop_string_chars", f"the engine accepts at most {MAX_STOP_STRING_CHARS}")
        for name in ("default_timeout_s", "max_timeout_s", "stream_backlog_grace_s", "stream_drain_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= MAX_REQUEST_TIMEOUT_S:
                raise InvalidRequestError(name, f"must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT_S}], "
                                                f"got {v!r}")
        if self.default_timeout_s > self.max_timeout_s:
            raise InvalidRequestError("default_timeout_s", "must be <= max_timeout_s")


class ServeOptions(BaseModel):
    """A served engine.

    Attributes:
        model: Hugging Face model folder (None: the demo checkpoint, built on first use).
        served_model_name: the OpenAI ``model`` id (default: the folder name).
        tp_size, dp_size, ep_size: parallel layout (``ep_size`` None: the world size ``dp_size * tp_size``).
        enable_tbo: two-batch overlap of MoE layers (None: on exactly when experts are sharded over CUDA ranks,
            ``ep_size > 1``; with one EP rank there is no all-to-all to hide, and between CPU ranks, whose
            shared-memory all-to-all is a copy with no latency to hide, splitting the batch only costs compute:
            served dp=2 ep=2 on 2 cores ran 30-60 % faster at concurrency 64 without it, docs/performance.md).
        dtype, seed, device: engine options. max_total_tokens, max_context_len: KV slots and context per group.
        max_running_requests, max_queued_requests: scheduler limits per DP group (a full queue answers 429).
        max_in_flight: requests the HTTP front end serves at once before 429 (None: from the scheduler limits).
        api_key: bearer token required on ``/v1/*`` (None: open); never shown in ``repr`` or logs.
        limits: per-request limits of the HTTP front end (body size, stop strings, deadline, stream backlog).
        ray_address: Ray cluster to join (None: a local one on 127.0.0.1, or the Serve cluster).
        fanout: how steps reach multi-rank worlds, ``"channel"`` | ``"compiled"`` | ``"remote"`` (None: the engine
            default).
        a2a_mode: MoE all-to-all mode, ``"normal"`` | ``"low_latency"`` | ``"auto"`` (None: the engine default,
            ``auto``: low-latency for decode steps).
        chunked_prefill_size: prompt tokens per step (None: the engine default). enable_mixed_chunk: prefill steps
            also decode the running requests (None: the engine default, on). disable_overlap_schedule: form each
            step only after the previous one finished (None: the engine default, overlap on).
        cpu_threads: intra-op threads of each CPU rank (None: the engine default, ``(cores - 1) // ranks``).
        cpu_rank_nice: nice value of each CPU rank's step thread in a multi-rank engine (None: the engine default,
            -10 where permitted; 0: unchanged).
        cpu_comm: MoE all-to-all carrier between CPU ranks, ``"auto"`` | ``"shm"`` | ``"gloo"`` (None: the engine
            default, ``auto``: shared memory when every rank is on one node).
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    served_model_name: str | None = None
    tp_size: int = Field(1, ge=1)
    dp_size: int = Field(2, ge=1)
    ep_size: int | None = Field(None, ge=1)
    enable_tbo: bool | None = None
    dtype: str = "float32"
    seed: int = 0
    device: str | None = None
    max_total_tokens: int | None = Field(None, ge=2)
    max_context_len: int | None = Field(None, ge=2)
    max_running_requests: int | None = Field(None, ge=1)
    max_queued_requests: int | None = Field(None, ge=1)
    max_in_flight: int | None = Field(None, ge=1)
    api_key: str | None = Field(None, repr=False)
    limits: ServerLimits = Field(default_factory=ServerLimits)
    ray_address: str | None = None
    fanout: str | None = None
    a2a_mode: str | None = None
    chunked_prefill_size: int | None = Field(None, ge=1)
    enable_mixed_chunk: bool | None = None
    disable_overlap_schedule: bool | None = None
    cpu_threads: int | None = Field(None, ge=1)
    cpu_rank_nice: int | None = Field(None, ge=-20, le=19)
    cpu_comm: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks of the engine: ``dp_size * tp_size``."""
        return self.tp_size * self.dp_size

    def resolved_model(self, progress: bool = True) -> str:
        """``model``, or the demo checkpoint (built with progress bars the first time)."""
        if self.model:
            return self.model
        from raymoe.models.checkpoint import default_model_path

        return str(default_model_path(progress=progress))

    def engine_config(self, model: str) -> EngineConfig:
        """The engine configuration for the model folder ``model``.

        Raises:
            InvalidRequestError: an option out of range (names it).
        """
        from raymoe.engine import _split_options

        options = {"tp_size": self.tp_size, "dp_size": self.dp_size,
                   "ep_size": self.ep_size if self.ep_size is not None else self.world_size,
                   "dtype": self.dtype, "seed": self.seed, "device": self.device,
                   "ray_address": self.ray_address}
        for name in ("max_total_tokens", "max_context_len", "max_running_requests", "max_queued_requests",
                     "fanout", "a2a_mode", "chunked_prefill_size", "enable_mixed_chunk", "disable_overlap_schedule",
                     "cpu_threads", "cpu_rank_nice", "cpu_comm"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        config = _split_options(model, options)
        tbo = self.enable_tbo
        if tbo is None:
            from raymoe.runner.device import engine_device

            tbo = config.parallel.ep_size > 1 and engine_device(config.device) == "cuda"
        return dataclasses.replace(config, overlap=dataclasses.replace(config.overlap, enable_tbo=tbo))

    def engine_client(self, progress: bool = True):
        """Start the engine: a driver actor on Ray (its own process, also for a single rank) and its ranks."""
        from raymoe.deploy.engine_client import EngineClient

        return EngineClient(self.engine_config(self.resolved_model(progress)), model_name=self.served_model_name)
