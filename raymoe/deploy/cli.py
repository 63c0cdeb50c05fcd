"""``raymoe serve``: its flags and its command.

The engine-option flags and the per-request limit flags are generated from the declarations (``ServeOptions``'
engine fields, which follow ``raymoe.config.engine_options``, and ``ServerLimits``); only the serve-only flags are
written here. A flag that is not given passes nothing on, so every option keeps the default of ``ServeOptions``.
"""

from __future__ import annotations

import argparse
import os

from raymoe.cli_args import add_option_flag, given_options, model_arg
from raymoe.config.engine_options import declared_options, engine_options
from raymoe.deploy.drain_config import DrainConfig
from raymoe.deploy.server_config import ServeOptions, ServerLimits
from raymoe.errors import InvalidRequestError


def add_serve_parser(sub) -> None:
    """Register ``raymoe serve`` on the top-level subparsers ``sub``."""
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (default: demo model, dp=2 ep=2)",
                       description="Serve the OpenAI-compatible API. Engine options are the Engine(model, **options) "
                                   "options (raymoe.config) and the Ray Serve app's args of the same names.")
    model_arg(p)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-in-flight", type=int, default=None, help="HTTP requests served at once before 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $RAYMOE_API_KEY)")
    p.add_argument("--demo-request", action="store_true", help="once ready, send one chat completion and print it")
    p.add_argument("--pd-prefill", default=None, metavar="TOPOLOGY",
                   help="prefill/decode disaggregation: the prefill engine's layout, e.g. 'dp=1' (with --pd-decode; "
                        "the engine options apply to both engines)")
    p.add_argument("--pd-decode", default=None, metavar="TOPOLOGY",
                   help="prefill/decode disaggregation: the decode engine's layout, e.g. 'dp=2,ep=2'")
    p.add_argument("--pd-kv-layerwise", default=True, action=argparse.BooleanOptionalAction,
                   help="prefill/decode disaggregation: write the prompt's KV layer by layer while the prefill "
                        "computes it (NIXL; --no-pd-kv-layerwise: after the prefill)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split a reasoning model's <think>...</think> into the chat answer's reasoning_content")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "qwen3", "deepseek_v3", "mistral", "harmony"],
                   help="the model's tool-call format (auto: from the model family)")
    p.add_argument("--engine-name", default=None, metavar="NAME",
                   help="register the engine under NAME so more front-end processes can serve it (--attach)")
    p.add_argument("--attach", default=None, metavar="NAME",
                   help="serve the running engine registered as NAME (join its Ray cluster with --ray-address) "
                        "instead of starting one; this front end gets only its own requests' outputs")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine = p.add_argument_group("engine options (raymoe.config; Serve config args of the same names)")
    for name, decl in engine_options().items():
        field = ServeOptions.model_fields[name]
        add_option_flag(engine, decl, help=field.description, shown_default=field.default)
    limits = p.add_argument_group("per-request limits (ServerLimits; README: Limits and failure behaviour)")
    for decl in declared_options(ServerLimits).values():
        add_option_flag(limits, decl)
    stop = p.add_argument_group("stopping (DrainConfig; README: Limits and failure behaviour)")
    for decl in declared_options(DrainConfig).values():
        add_option_flag(stop, decl)
    p.set_defaults(func=_cmd_serve)


def limits_from_args(a: argparse.Namespace):
    """``ServerLimits`` from the limit flags that were given (the rest keep their defaults).

    Raises:
        InvalidRequestError: a limit out of range (names it).
    """
    return ServerLimits(**given_options(a, declared_options(ServerLimits)))


def drain_from_args(a: argparse.Namespace) -> DrainConfig:
    """``DrainConfig`` from the stopping flags that were given (the rest keep their defaults).

    Raises:
        InvalidRequestError: a value out of range (names it).
    """
    return DrainConfig(**given_options(a, declared_options(DrainConfig)))


def serve_options_from_args(a: argparse.Namespace):
    """The ``ServeOptions`` of the parsed ``raymoe serve`` flags.

    Raises:
        InvalidRequestError: a bad option (names it; pydantic's errors are turned into it).
    """
    from pydantic import ValidationError

    try:
        return ServeOptions(model=a.model, served_model_name=a.served_model_name, max_in_flight=a.max_in_flight,
                            api_key=a.api_key or os.environ.get("RAYMOE_API_KEY"), limits=limits_from_args(a),
                            pd_prefill=a.pd_prefill, pd_decode=a.pd_decode, pd_kv_layerwise=a.pd_kv_layerwise,
                            reasoning_parser=a.reasoning_parser,
                            tool_call_parser=a.tool_call_parser, engine_name=a.engine_name, attach=a.attach,
                            **given_options(a, engine_options()))
    except ValidationError as e:
        first = e.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, InvalidRequestError):
            raise cause from None
        raise InvalidRequestError(".".join(map(str, first["loc"])), first["msg"]) from None


def _cmd_serve(a: argparse.Namespace) -> None:
    from raymoe.deploy.server import run_server

    run_server(serve_options_from_args(a), host=a.host, port=a.port, demo_request=a.demo_request,
               log_level=a.log_level, drain=drain_from_args(a))
