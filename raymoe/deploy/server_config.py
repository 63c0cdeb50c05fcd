"""Options of a serving deployment, shared by ``raymoe serve`` and the Ray Serve app (``serve_app.build_app``).

:class:`ServerLimits` declares what one HTTP request may ask of the server. :class:`ServeOptions` is a pydantic model
so the ``args`` of a Serve config file are validated with clear errors: its engine options are generated from the
engine's option declarations (``raymoe.config.engine_options``: same names, types, choices, help and defaults),
beside a few serve-only fields (:data:`SERVE_ONLY_FIELDS`) and the serve defaults of :data:`SERVE_DEFAULTS`: two
DP-attention groups of one rank each, experts sharded over both (``ep_size`` = world size).
:meth:`ServeOptions.engine_config` turns it into the engine's frozen ``EngineConfig`` (through the same flat options
as ``Engine(model, **options)``); its device and the defaults that follow from it (dtype, two-batch overlap, ...)
are decided by the ``EngineClient`` once Ray is joined (``raymoe.cluster.device_choice``), never in the front
end's own process from its own GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from raymoe.config import EngineConfig
from raymoe.config.engine_options import OptionDecl, check_options, engine_config_from_options, engine_options
from raymoe.config.option import option
from raymoe.deploy.body_limits import CAPS, BodyLimits
from raymoe.deploy.protocol import MAX_REQUEST_TIMEOUT_S
from raymoe.errors import InvalidRequestError
from raymoe.scheduler.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

# Most an operator may allow for the request head (request line and headers), bytes, and for its header count.
CAP_HEADER_BYTES = 1 << 20
CAP_HEADERS = 1024
_BODY = BodyLimits()  # the structural limits' defaults, declared once in body_limits


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP request may ask of the server (each field's help says what it bounds); README "Limits and
    failure behaviour" lists what a client sees when each is hit.

    Raises:
        InvalidRequestError: naming the field that is out of range.
    """

    max_body_bytes: int = option(
        16 * 2**20, help="largest request body, bytes; larger ones get 413 before they are parsed (also chunked bodies "
                         "without a Content-Length).")
    max_header_bytes: int = option(
        64 * 1024, help=f"largest request head (request line and headers), bytes; a longer one gets 431 while it is "
                        f"still arriving, so the HTTP parser never holds more than this plus one socket read. At most "
                        f"{CAP_HEADER_BYTES}.")
    max_headers: int = option(100, help=f"most header fields per request (431 beyond); at most {CAP_HEADERS}.")
    max_messages: int = option(
        _BODY.max_messages, help=f"chat messages per request (400 param=messages beyond), counted while the body is "
                                 f"parsed; at most {CAPS['max_messages']}.")
    max_message_parts: int = option(
        _BODY.max_message_parts, help=f"content parts per chat message (400 param=messages beyond), counted while the "
                                      f"body is parsed; at most {CAPS['max_message_parts']}.")
    max_logit_bias: int = option(
        _BODY.max_logit_bias, help=f"logit_bias entries (400 param=logit_bias beyond); at most "
                                   f"{CAPS['max_logit_bias']}.")
    max_prompt_token_ids: int = option(
        _BODY.max_prompt_token_ids, help=f"token ids in a token-id prompt (400 param=prompt beyond), counted while the "
                                         f"body is parsed (the context length is checked after); at most "
                                         f"{CAPS['max_prompt_token_ids']}.")
    max_json_depth: int = option(
        _BODY.max_json_depth, help=f"nesting levels of JSON arrays and objects in a body, the body itself being "
                                   f"level 1 (400 naming the top-level field that nests deeper); at most "
                                   f"{CAPS['max_json_depth']}.")
    max_stop_strings: int = option(
        64, help=f"stop strings per request (400 param=stop beyond); at most the engine's cap, {MAX_STOP_STRINGS}.")
    max_stop_string_chars: int = option(
        512, help=f"characters per stop string (400 param=stop beyond); at most the engine's cap, "
                  f"{MAX_STOP_STRING_CHARS}.")
    default_timeout_s: float = option(
        600.0, help="deadline of a request that sends no timeout, seconds from its arrival.")
    max_timeout_s: float = option(
        3600.0, help="largest timeout a request may send, seconds (400 param=timeout beyond).")
    max_stream_backlog_events: int = option(
        512, help="SSE events of one stream produced but not yet written to its socket; past it the client is "
                  "reading too slowly: the request is aborted and the stream ends with an error event.")
    max_stream_backlog_bytes: int = option(2**20, help="the same bound in bytes of those events.")
    stream_backlog_grace_s: float = option(
        1.0, help="how long a stream's backlog may stay at its bound before the reader counts as slow, seconds "
                  "(absorbs scheduling jitter: several engine steps can arrive at once).")
    stream_drain_timeout_s: float = option(
        30.0, help="once a stream's generation has ended (finished, timed out or aborted), how long its remaining "
                   "events may take to reach a slow reader before the connection is closed, seconds.")

    def __post_init__(self) -> None:
        for name, low in (("max_body_bytes", 1), ("max_stop_strings", 0), ("max_stop_string_chars", 1),
                          ("max_stream_backlog_events", 1), ("max_stream_backlog_bytes", 1),
                          ("max_header_bytes", 1024), ("max_headers", 8)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise InvalidRequestError(name, f"must be an integer >= {low}, got {v!r}")
        if self.max_header_bytes > CAP_HEADER_BYTES:
            raise InvalidRequestError("max_header_bytes", f"must be <= {CAP_HEADER_BYTES}")
        if self.max_headers > CAP_HEADERS:
            raise InvalidRequestError("max_headers", f"must be <= {CAP_HEADERS}")
        for name in CAPS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= CAPS[name]:
                raise InvalidRequestError(name, f"must be an integer in [1, {CAPS[name]}], got {v!r}")
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

    def body_limits(self) -> BodyLimits:
        """The structural limits the body parser checks (a light record: the parse workers get it with each body)."""
        return BodyLimits(**{name: getattr(self, name) for name in CAPS})


class _ServeFields(BaseModel):
    """The serve-only fields of :class:`ServeOptions` and its methods (the engine options are added to it)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(None, description="Hugging Face model folder (None: the demo checkpoint, built on "
                                                "first use).")
    served_model_name: str | None = Field(None, description="the OpenAI model id clients send (None: the folder "
                                                            "name).")
    max_in_flight: int | None = Field(None, ge=1, description="HTTP requests served at once before 429 (None: from "
                                                              "the scheduler limits).")
    api_key: str | None = Field(None, repr=False, description="bearer token required on /v1/* (None: open); never "
                                                              "shown in repr or logs.")
    limits: ServerLimits = Field(default_factory=ServerLimits, description="per-request limits of the HTTP front "
                                                                           "end (ServerLimits).")
    pd_prefill: str | None = Field(None, description="prefill/decode disaggregation: the prefill engine's layout "
                                                     "('dp=1'; raymoe.client.pd_config), with pd_decode.")
    pd_decode: str | None = Field(None, description="prefill/decode disaggregation: the decode engine's layout "
                                                    "('dp=2,ep=2').")
    pd_kv_layerwise: bool = Field(True, description="prefill/decode disaggregation: the prefill ranks write the "
                                                    "prompt's KV layer by layer while they compute it, where the "
                                                    "transfer writes one-sided (NIXL); false: after the prefill.")
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None, description="split a reasoning model's thinking (<think>...</think>) into the chat answer's "
                          "reasoning_content (raymoe.deploy.reasoning; None: all text is content).")
    tool_call_parser: Literal["auto", "qwen3", "deepseek_v3", "mistral", "harmony"] | None = Field(
        "auto", description="the model's tool-call format (raymoe.deploy.tool_calls; auto: from the model family, "
                            "harmony for gpt-oss: raymoe.deploy.harmony; None: requests with tools are refused).")
    engine_name: str | None = Field(None, min_length=1, description="register the engine under this name, so "
                                    "more front-end processes can serve it (attach).")
    attach: str | None = Field(None, min_length=1, description="serve the running engine registered under this "
                               "name instead of starting one (its model and engine options are the engine's; this "
                               "front end gets only its own requests' outputs; raymoe.actors.frontends).")

    @model_validator(mode="after")
    def _check_engine_options(self) -> _ServeFields:
        """Every engine option checked as the engine will, except what depends on the machine it runs on
        (``raymoe.config.engine_options.check_options``); a bad one raises ``InvalidRequestError`` (naming it),
        which pydantic reports as a ``ValidationError`` holding that error."""
        check_options(self.engine_option_values())
        if (self.pd_prefill is None) != (self.pd_decode is None):
            raise InvalidRequestError("pd_decode" if self.pd_decode is None else "pd_prefill",
                                      "prefill/decode disaggregation needs both pd_prefill and pd_decode")
        if self.attach is not None and (self.engine_name is not None or self.pd_prefill is not None):
            raise InvalidRequestError("attach", "an attached front end starts no engine: engine_name and "
                                                "pd_prefill/pd_decode belong to the process that starts it")
        if self.pd_prefill is not None:
            from raymoe.client.pd_config import parse_pd_topology

            parse_pd_topology("pd_prefill", self.pd_prefill)
            parse_pd_topology("pd_decode", self.pd_decode)
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the engine: ``dp_size * tp_size``."""
        return self.tp_size * self.dp_size

    def engine_option_values(self) -> dict[str, Any]:
        """The flat engine options with the serve rule applied: ``ep_size`` None is the world size (per-device
        defaults stay undecided: ``raymoe.config.device_defaults``)."""
        values = {name: getattr(self, name) for name in engine_options()}
        if values["ep_size"] is None:
            values["ep_size"] = self.world_size
        return values

    def resolved_model(self, progress: bool = True) -> str:
        """``model``, or the demo checkpoint (built with progress bars the first time); ``demo-trained`` and
        ``demo-trained-deepseek``: the trained demo checkpoints (trained for minutes the first time)."""
        from raymoe.models.checkpoint import TRAINED_DEMOS, default_model_path, trained_model_path

        if self.model in TRAINED_DEMOS:
            return str(trained_model_path(TRAINED_DEMOS[self.model], progress=progress))
        if self.model:
            return self.model

        return str(default_model_path(progress=progress))

    def engine_config(self, model: str) -> EngineConfig:
        """The engine configuration for the model folder ``model``.

        Raises:
            InvalidRequestError: an option out of range, or a backend this machine cannot run (names it).
        """
        return engine_config_from_options(model, self.engine_option_values())

    def engine_client(self, progress: bool = True):
        """Start the engine: a driver actor on Ray (its own process, also for a single rank) and its ranks; the
        device is decided there, once Ray is joined.

        Raises:
            InvalidRequestError: a bad option, or ``device="cuda"`` where Ray declares no GPU (names CUDA).
            EngineUnhealthyError: the driver or its ranks failed to start.
        """
        from raymoe.client.engine_client import EngineClient

        if self.attach is not None:
            return EngineClient.attach(self.attach, model_name=self.served_model_name, ray_address=self.ray_address)
        model = self.resolved_model(progress)
        if self.pd_prefill is not None:
            from raymoe.client.pd_client import PDEngineClient
            from raymoe.client.pd_config import pd_engine_configs

            configs = pd_engine_configs(model, self.engine_option_values(), self.pd_prefill, self.pd_decode)
            return PDEngineClient(*configs, model_name=self.served_model_name, layerwise=self.pd_kv_layerwise)
        return EngineClient(self.engine_config(model), model_name=self.served_model_name,
                            engine_name=self.engine_name)


SERVE_ONLY_FIELDS = tuple(_ServeFields.model_fields)
"""ServeOptions fields that are not engine options: model, served_model_name, max_in_flight, api_key, limits,
pd_prefill, pd_decode, pd_kv_layerwise, reasoning_parser, tool_call_parser, engine_name, attach."""

SERVE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "dp_size": (int, Field(2, description="DP-attention groups (each schedules its own requests).")),
    "ep_size": (int | None, Field(None, description="expert-parallel ranks: 1 or dp*tp (None: dp*tp, the experts "
                                                    "sharded over every rank).")),
}
"""Engine options whose serve default differs from the engine's: (annotation, pydantic field)."""


def _engine_field(decl: OptionDecl) -> tuple[Any, Any]:
    """The pydantic field of one engine option: its declared type (a ``Literal`` of its choices, where declared),
    default and help."""
    annotation = decl.type
    if decl.choices is not None:
        annotation = Literal[decl.choices]  # type: ignore[valid-type]
        if decl.default is None:
            annotation = annotation | None
    return annotation, Field(decl.default, description=decl.help)


ServeOptions = create_model(
    "ServeOptions", __base__=_ServeFields, __module__=__name__,
    __doc__="""A served engine: the serve-only fields (:data:`SERVE_ONLY_FIELDS`) and every engine option
    (``raymoe.config.engine_options()``), with the serve defaults of :data:`SERVE_DEFAULTS`.

    Raises:
        pydantic.ValidationError: an unknown field, a value of the wrong type or not among its choices, or an
            engine option its config refuses (the error holds the ``InvalidRequestError`` naming it).
    """,
    **{name: SERVE_DEFAULTS.get(name) or _engine_field(decl) for name, decl in engine_options().items()})
