"""The flat option namespace of ``Engine(model, **options)``, ``raymoe serve`` and the Ray Serve app's args.

Every option field of ``EngineConfig`` and of its option groups (``cache``, ``scheduler``, ``parallel``,
``overlap``, ``graph``, ``moe_comm``) is one flat option of the same name; :func:`engine_options` lists them with
their declarations (help, choices, flags, defaults: ``raymoe.config.option``) and types, and
:func:`engine_config_from_options` builds the ``EngineConfig`` of a flat option dict.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raymoe.config.engine import EngineConfig, check_engine_options
from raymoe.config.option import is_option, option_choices, option_flags, option_help
from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class OptionDecl:
    """One declared option: the dataclass field, where it lives and its resolved type.

    Attributes:
        field: the declaring dataclass field (``option(...)`` metadata).
        owner: the config class that declares it.
        section: the ``EngineConfig`` field holding ``owner`` (``"cache"`` ...); None for ``EngineConfig``'s own
            options and for classes outside the engine (e.g. ``ServerLimits``).
        type: the field's annotation, resolved (e.g. ``int | None``).
    """

    field: dataclasses.Field
    owner: type
    section: str | None
    type: Any

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        return self.field.default

    @property
    def help(self) -> str:
        return option_help(self.field)

    @property
    def choices(self) -> tuple[Any, ...] | None:
        return option_choices(self.field)

    @property
    def flags(self) -> tuple[str, ...]:
        return option_flags(self.field)


def declared_options(cls: type, section: str | None = None) -> dict[str, OptionDecl]:
    """The option fields of dataclass ``cls`` by name, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: OptionDecl(f, cls, section, hints[f.name]) for f in dataclasses.fields(cls) if is_option(f)}


@functools.cache
def engine_sections() -> dict[str, type]:
    """``EngineConfig``'s option groups: field name -> config class (``{"cache": CacheConfig, ...}``)."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig) if dataclasses.is_dataclass(hints[f.name])}


@functools.cache
def engine_options() -> dict[str, OptionDecl]:
    """Every flat engine option by name: ``EngineConfig``'s own, then each group's in field order."""
    options = declared_options(EngineConfig)
    for section, cls in engine_sections().items():
        options.update(declared_options(cls, section))
    return options


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Sort flat ``options`` into ``EngineConfig``'s own and one dict per option group.

    Raises:
        InvalidRequestError: an unknown option (names it).
    """
    decls = engine_options()
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {section: {} for section in engine_sections()}
    for name, value in options.items():
        decl = decls.get(name)
        if decl is None:
            raise InvalidRequestError(name, "unknown engine option")
        (top if decl.section is None else parts[decl.section])[name] = value
    return top, parts


def check_options(options: Mapping[str, Any]) -> None:
    """Check flat ``options`` as far as their values allow, without building an ``EngineConfig``: every option
    group is built (its ``__post_init__`` checks run) and ``EngineConfig``'s own options are checked by
    ``check_engine_options``; what depends on this machine (CUDA, GPU packages) is left to the engine.

    Raises:
        InvalidRequestError: an unknown or bad option (names it).
    """
    top, parts = split_options(options)
    for section, cls in engine_sections().items():
        cls(**parts[section])
    check_engine_options(top)


def engine_config_from_options(model: str, options: Mapping[str, Any]) -> EngineConfig:
    """The ``EngineConfig`` of model folder ``model`` and flat ``options`` (absent ones keep their defaults).

    Raises:
        InvalidRequestError: an unknown or bad option (names it).
    """
    top, parts = split_options(options)
    return EngineConfig(model=model, **{section: cls(**parts[section]) for section, cls in engine_sections().items()},
                        **top)
