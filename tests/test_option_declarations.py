"""Every engine option is declared once (``raymoe.config.option``) and everything else derives from it: the
``raymoe serve`` / ``raymoe generate`` flags, the Ray Serve app's args (``ServeOptions``) and the flat
``Engine(model, **options)`` names. Checks both directions of each mapping, that help and choices are the declared
ones, that a wrong choice is an error naming the field, and that the command-line modules depend one way."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pydantic
import pytest

from raymoe.cli import GENERATE_OWN_FLAGS, build_parser
from raymoe.config import EngineConfig, engine_config_from_options, engine_options
from raymoe.config.engine_options import declared_options, engine_sections
from raymoe.config.option import is_option
from raymoe.deploy.drain_config import DrainConfig
from raymoe.deploy.server_config import SERVE_DEFAULTS, SERVE_ONLY_FIELDS, ServeOptions, ServerLimits
from raymoe.errors import InvalidRequestError

ROOT = Path(__file__).resolve().parent.parent
SERVE_ONLY_FLAGS = {"model", "served_model_name", "max_in_flight", "api_key", "host", "port", "demo_request",
                    "log_level", "help", "pd_prefill", "pd_decode", "pd_kv_layerwise", "reasoning_parser",
                    "tool_call_parser", "engine_name", "attach"}
"""``raymoe serve`` flags that are neither engine options nor limits (documented in README, Serve)."""


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _actions(name: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _subparser(name)._actions}


def test_every_option_field_is_declared_with_help():
    for cls in (EngineConfig, *engine_sections().values(), ServerLimits, DrainConfig):
        for f in dataclasses.fields(cls):
            if cls is EngineConfig and (f.name == "model" or f.name in engine_sections()):
                continue
            assert is_option(f), f"{cls.__name__}.{f.name} is not declared with option()"
            assert f.metadata["help"].strip(), f"{cls.__name__}.{f.name} has no help"


def test_serve_flags_map_to_declarations_and_back():
    actions = _actions("serve")
    options, limits = engine_options(), {**declared_options(ServerLimits), **declared_options(DrainConfig)}
    assert set(actions) <= set(options) | set(limits) | SERVE_ONLY_FLAGS, set(actions) - set(options) - set(limits)
    assert set(options) <= set(actions), set(options) - set(actions)  # every engine option has a flag
    assert set(limits) <= set(actions), set(limits) - set(actions)  # every limit and stop setting too
    assert actions["shutdown_timeout_s"].option_strings[0] == "--shutdown-timeout"
    for name, decl in {**options, **limits}.items():
        action = actions[name]
        negated = tuple(f"--no-{f[2:]}" for f in decl.flags) if decl.type in (bool, bool | None) else ()
        assert set(action.option_strings) == {*decl.flags, *negated}, name
        assert action.choices == decl.choices, name
        assert action.default is argparse.SUPPRESS, name  # not given: ServeOptions' default applies
    for name in ("tp_size", "dp_size", "ep_size", "ray_address"):  # the short flags of the declarations
        assert actions[name].option_strings[0] == {"tp_size": "--tp", "dp_size": "--dp", "ep_size": "--ep",
                                                   "ray_address": "--address"}[name]


def test_serve_help_lists_the_gpu_backend_and_device_options(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag, choices in (("--attention-backend", "{torch_native,flash_attn,flashinfer_mla}"),
                          ("--a2a-backend", "{torch,deepep}"),
                          ("--a2a-mode", "{normal,low_latency,auto}"), ("--device", "{auto,cpu,cuda}"),
                          ("--dtype", "{auto,float32,bfloat16,float16}"),
                          ("--group-schedulers", "{auto,driver,actors}"),
                          ("--num-max-dispatch-tokens-per-rank", "N|none"), ("--cuda-graph-bs", "N [N ...]"),
                          ("--placement-timeout-s", "X"), ("--load-timeout-s", "X|none")):
        assert f"{flag} {choices}" in text, flag


def test_serve_help_comes_from_the_declarations():
    actions = _actions("serve")
    for name, decl in engine_options().items():
        description = ServeOptions.model_fields[name].description
        if name not in SERVE_DEFAULTS:
            assert description == decl.help, name
        assert actions[name].help.startswith(description.replace("%", "%%")), name
    for name, decl in {**declared_options(ServerLimits), **declared_options(DrainConfig)}.items():
        assert actions[name].help.startswith(decl.help), name


def test_serve_config_keys_map_to_declarations_and_back():
    fields = set(ServeOptions.model_fields)
    options = set(engine_options())
    assert fields == options | set(SERVE_ONLY_FIELDS)
    assert not options & set(SERVE_ONLY_FIELDS)
    assert set(SERVE_ONLY_FIELDS) == {"model", "served_model_name", "max_in_flight", "api_key", "limits", "pd_prefill",
                                      "pd_decode", "pd_kv_layerwise", "reasoning_parser", "tool_call_parser",
                                      "engine_name", "attach"}
    for name, decl in engine_options().items():  # same defaults as the engine, except the documented serve ones
        if name not in SERVE_DEFAULTS:
            assert ServeOptions.model_fields[name].default == decl.default, name
    assert {n: ServeOptions.model_fields[n].default for n in SERVE_DEFAULTS} == {"dp_size": 2, "ep_size": None}


def test_serve_defaults_give_the_documented_engine():
    config = ServeOptions(device="cpu").engine_config("/m")
    assert (config.parallel.dp_size, config.parallel.ep_size, config.overlap.enable_tbo) == (2, 2, None)
    defaults = EngineConfig(model="/m", device="cpu")
    assert dataclasses.replace(config, parallel=defaults.parallel) == defaults
    assert (config.device, config.dtype, config.fanout, config.group_schedulers) == ("cpu", "auto", None, "auto")
    assert not config.resolved  # the per-device defaults are decided once Ray is joined, not in the front end


@pytest.mark.parametrize("name", [n for n, d in engine_options().items() if d.choices])
def test_a_wrong_choice_is_an_error_naming_the_field(name, capsys):
    choices = engine_options()[name].choices
    with pytest.raises(InvalidRequestError) as e:
        engine_config_from_options("/m", {name: "not-a-choice"})
    assert e.value.field == name and all(repr(c) in e.value.message for c in choices)
    with pytest.raises(pydantic.ValidationError) as v:
        ServeOptions(**{name: "not-a-choice"})
    assert v.value.errors()[0]["loc"] == (name,)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", engine_options()[name].flags[0], "not-a-choice"])
    assert engine_options()[name].flags[0] in capsys.readouterr().err


def test_engine_option_errors_name_the_field_everywhere():
    with pytest.raises(InvalidRequestError) as e:
        engine_config_from_options("/m", {"max_running_request": 4})
    assert e.value.field == "max_running_request"
    with pytest.raises(pydantic.ValidationError) as v:  # a Serve config's range error holds the typed error
        ServeOptions(max_running_requests=0)
    cause = v.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, InvalidRequestError) and cause.field == "max_running_requests"
    from raymoe.deploy.cli import serve_options_from_args

    with pytest.raises(InvalidRequestError) as e:
        serve_options_from_args(build_parser().parse_args(["serve", "--cpu-rank-nice", "40"]))
    assert e.value.field == "cpu_rank_nice"


def test_flags_parse_to_the_declared_types():
    from raymoe.deploy.cli import serve_options_from_args

    argv = ["serve", "--cuda-graph-bs", "1", "4", "--chunked-prefill-size", "none", "--no-enable-mixed-chunk",
            "--disable-overlap-schedule", "--tbo-token-distribution-threshold", "0.4", "--address", "auto",
            "--default-timeout-s", "30"]
    opts = serve_options_from_args(build_parser().parse_args(argv))
    assert (opts.cuda_graph_bs, opts.chunked_prefill_size, opts.enable_mixed_chunk) == ((1, 4), None, False)
    assert (opts.disable_overlap_schedule, opts.tbo_token_distribution_threshold) == (True, 0.4)
    assert (opts.ray_address, opts.limits.default_timeout_s) == ("auto", 30.0)
    config = opts.engine_config("/m")
    assert config.graph.cuda_graph_bs == (1, 4) and config.scheduler.chunked_prefill_size is None


def test_generate_flags_are_the_engine_options():
    actions = _actions("generate")
    own = {"help", "model", "prompt", "max_tokens", "temperature", "seed"}
    assert set(actions) == (set(engine_options()) - set(GENERATE_OWN_FLAGS)) | own
    args = build_parser().parse_args(["generate", "--prompt", "x", "--tp", "2", "--a2a-mode", "normal", "--seed", "3"])
    from raymoe.cli_args import given_options

    assert given_options(args, engine_options()) == {"tp_size": 2, "a2a_mode": "normal", "seed": 3}
    assert "seed" in GENERATE_OWN_FLAGS  # --seed is the sampling seed there, never passed to the engine


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names


def test_command_line_modules_depend_one_way():
    """raymoe.cli assembles deploy's and bench's subcommands; neither imports it, deploy never imports bench, and no
    command line module hides an import behind importlib."""
    for path in (ROOT / "raymoe" / "deploy").glob("*.py"):
        assert not {m for m in _imports(path) if m.split(".")[:2] in (["raymoe", "bench"], ["raymoe", "cli"])}, path
    for path in (ROOT / "raymoe" / "bench").glob("*.py"):
        assert not {m for m in _imports(path) if m in ("raymoe.cli", "raymoe.deploy.cli")}, path
    for path in (ROOT / "raymoe" / "cli.py", ROOT / "raymoe" / "cli_args.py", ROOT / "raymoe" / "deploy" / "cli.py",
                 ROOT / "raymoe" / "bench" / "cli.py"):
        assert "importlib" not in _imports(path), path
