"""Option declarations: each engine option is one field of a frozen config dataclass, declared with :func:`option`,
which keeps its help text, its choices and its command-line flag in the field's metadata.

Everything that lists options reads these declarations instead of repeating them: the flat option names of
``Engine(model, **options)`` (``raymoe.config.engine_options``), the ``raymoe serve`` and ``raymoe generate`` flags
(``raymoe.cli_args``) and the Ray Serve app's args (``raymoe.deploy.server_config.ServeOptions``). A config's
``__post_init__`` checks the choices with :func:`check_choices` (so they are written once) and everything else by
hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from raymoe.errors import InvalidRequestError

HELP = "help"
CHOICES = "choices"
FLAG = "flag"


def option(default: Any = dataclasses.MISSING, *, help: str, choices: Sequence[Any] | None = None,
           flag: str | None = None) -> Any:
    """A dataclass field that declares an option.

    Args:
        default: the option's default value (immutable: the configs are frozen).
        help: what the option means, with its unit and what ``None`` stands for (shown by ``raymoe serve --help``
            and as the Serve arg's description).
        choices: the values the option accepts (``None`` is accepted besides them when the default is ``None``).
        flag: the command-line flag without its dashes when it is not the field name with ``-`` for ``_``
            (e.g. ``"tp"`` for ``tp_size``); the long name works too.
    """
    metadata: dict[str, Any] = {HELP: help}
    if choices is not None:
        metadata[CHOICES] = tuple(choices)
    if flag is not None:
        metadata[FLAG] = flag
    return dataclasses.field(default=default, metadata=metadata)


def is_option(f: dataclasses.Field) -> bool:
    """Whether dataclass field ``f`` was declared with :func:`option`."""
    return HELP in f.metadata


def option_help(f: dataclasses.Field) -> str:
    """The declared help text of option field ``f``."""
    return f.metadata[HELP]


def option_choices(f: dataclasses.Field) -> tuple[Any, ...] | None:
    """The declared choices of option field ``f`` (None: any value of its type)."""
    return f.metadata.get(CHOICES)


def option_flags(f: dataclasses.Field) -> tuple[str, ...]:
    """Command-line flags of option field ``f``: ``--<flag>`` when declared, and always ``--<name-with-dashes>``."""
    long = "--" + f.name.replace("_", "-")
    short = f.metadata.get(FLAG)
    return (f"--{short}", long) if short else (long,)


def check_choice(f: dataclasses.Field, value: Any) -> None:
    """Refuse ``value`` for option field ``f`` when it is not among the declared choices.

    Raises:
        InvalidRequestError: naming the field and the choices.
    """
    choices = option_choices(f)
    if choices is None or value in choices or (value is None and f.default is None):
        return
    listed = ", ".join(repr(c) for c in choices)
    raise InvalidRequestError(f.name, f"must be one of {listed}{' or None' if f.default is None else ''}, "
                                      f"got {value!r}")


def check_choices(config: Any) -> None:
    """:func:`check_choice` for every option field of the dataclass instance ``config``.

    Raises:
        InvalidRequestError: the first field whose value is not among its choices.
    """
    for f in dataclasses.fields(config):
        check_choice(f, getattr(config, f.name))
