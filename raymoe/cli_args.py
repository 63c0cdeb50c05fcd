"""Command-line pieces the ``raymoe`` subcommands share: the ``--model`` argument and flags generated from option
declarations (``raymoe.config.option``).

``raymoe.cli``, ``raymoe.deploy.cli`` and ``raymoe.bench.cli`` import this module; it imports none of them.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

from raymoe.config.engine_options import OptionDecl

_FROM_DECLARATION = object()


def model_arg(p: argparse.ArgumentParser) -> None:
    """Add ``--model`` (a Hugging Face folder; default: the demo checkpoint)."""
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the demo checkpoint, "
                                                 "built on first use; demo-trained / demo-trained-deepseek: the "
                                                 "demo trained on Python source, trained on first use)")


def resolve_model(model: str | None) -> str:
    """``model`` or the demo checkpoint path (built with a progress bar the first time); ``demo-trained`` and
    ``demo-trained-deepseek`` name the trained demo checkpoints (``raymoe.models.checkpoint.trained_model_path``,
    trained for minutes the first time)."""
    from raymoe.models.checkpoint import TRAINED_DEMOS, default_model_path, trained_model_path

    if model in TRAINED_DEMOS:
        return str(trained_model_path(TRAINED_DEMOS[model], progress=True))
    if model:
        return model

    return str(default_model_path(progress=True))


def add_option_flag(parser, decl: OptionDecl, *, help: str | None = None,
                    shown_default: Any = _FROM_DECLARATION) -> None:
    """Add the flag of option ``decl`` to ``parser`` (a parser or an argument group), all from the declaration:
    its names (``OptionDecl.flags``), its type (a bool is ``--x`` / ``--no-x``, a tuple takes several values, and
    ``none`` stands for None where the type allows None), its choices and its help. The flag's destination is the
    option's name, and a flag that is not given leaves no attribute (``argparse.SUPPRESS``), so only the options a
    user gave are passed on and every other keeps the default of whatever receives them (:func:`given_options`).

    Args:
        help: replaces the declared help (e.g. where a command has its own default).
        shown_default: the default the help names (default: the declaration's).
    """
    shown = decl.default if shown_default is _FROM_DECLARATION else shown_default
    text = f"{help or decl.help} (default: {_show(shown)})".replace("%", "%%")
    parser.add_argument(*decl.flags, dest=decl.name, default=argparse.SUPPRESS, help=text, **_value_kwargs(decl))


def add_option_flags(parser, decls: Iterable[OptionDecl]) -> None:
    """:func:`add_option_flag` for each of ``decls``, with their declared help and defaults."""
    for decl in decls:
        add_option_flag(parser, decl)


def given_options(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The options among ``names`` that were given on the command line (flags added by :func:`add_option_flag`)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _value_kwargs(decl: OptionDecl) -> dict[str, Any]:
    """``add_argument`` keywords that parse the option's values: action or type, nargs, choices, metavar."""
    base, optional = _unwrap_optional(decl.type)
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(base) is tuple:
        return {"type": typing.get_args(base)[0], "nargs": "+", "metavar": "N"}
    if decl.choices is not None:
        return {"type": base, "choices": decl.choices}
    return {"type": _or_none(base) if optional else base, "metavar": _metavar(base, optional)}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(tp, False)``."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _or_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag type that reads ``none`` as None and anything else with ``convert``."""
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names it in "invalid int value" errors
    return parse


def _metavar(base: Any, optional: bool) -> str:
    name = {int: "N", float: "X", str: "TEXT"}.get(base, "VALUE")
    return f"{name}|none" if optional else name


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
