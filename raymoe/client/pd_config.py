"""The two engines of prefill/decode disaggregation from one set of options and two topology strings.

``pd_prefill="dp=1"`` and ``pd_decode="dp=2,ep=2"`` (the form ``raymoe bench compare`` takes: ``dp``, ``tp``,
``ep``, ``tbo`` = 0/1) override the layout of the shared engine options for each side; everything else (model,
dtype, KV sizes, scheduler limits, graphs) is the same on both. Both run their DP groups' schedulers in the driver
(the PD hand-off reserves and receives KV there, ``raymoe.actors.driver``), and the prefill engine keeps its radix
cache (its prompt KV is exported from it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raymoe.config import EngineConfig, engine_config_from_options
from raymoe.errors import InvalidRequestError

_KEYS = {"dp": "dp_size", "tp": "tp_size", "ep": "ep_size", "tbo": "enable_tbo"}


def parse_pd_topology(field: str, topology: str) -> dict[str, Any]:
    """``'dp=2,ep=2'`` -> ``{'dp_size': 2, 'ep_size': 2}`` (``ep`` defaults to ``dp * tp``).

    Raises:
        InvalidRequestError: a malformed item, an unknown key or a bad value (names ``field``).
    """
    out: dict[str, Any] = {}
    for item in (x.strip() for x in topology.split(",") if x.strip()):
        key, sep, value = item.partition("=")
        if not sep or key not in _KEYS or not value.isdigit():
            raise InvalidRequestError(field, f"bad item {item!r} in {topology!r}: expected KEY=N with KEY one of "
                                             f"{', '.join(_KEYS)}")
        out[_KEYS[key]] = bool(int(value)) if key == "tbo" else int(value)
    if not out:
        raise InvalidRequestError(field, "empty topology (e.g. 'dp=2,ep=2')")
    out.setdefault("ep_size", out.get("dp_size", 1) * out.get("tp_size", 1))
    return out


def pd_engine_configs(model: str, options: Mapping[str, Any], prefill: str, decode: str
                      ) -> tuple[EngineConfig, EngineConfig]:
    """The prefill and decode engines' configurations (module docstring).

    Raises:
        InvalidRequestError: a bad topology or option (names it), the radix cache turned off (names
            ``enable_radix_cache``), or a model family whose requests cannot move by KV (``pd_prefill``).
    """
    from raymoe.config.model import ModelConfig
    from raymoe.config.model_rules import refuse_pd

    refuse_pd(ModelConfig.from_hf(model))
    if options.get("swa_kv_eviction"):
        raise InvalidRequestError("swa_kv_eviction", "a request's sliding-window rings do not move with its KV: "
                                                     "prefill/decode disaggregation runs without swa_kv_eviction")
    if options.get("enable_radix_cache") is False:
        raise InvalidRequestError("enable_radix_cache", "prefill/decode disaggregation exports the prompt's KV from "
                                                        "the prefill engine's radix cache: keep it on")
    base = {**options, "group_schedulers": "driver"}
    return (engine_config_from_options(model, {**base, **parse_pd_topology("pd_prefill", prefill)}),
            engine_config_from_options(model, {**base, **parse_pd_topology("pd_decode", decode)}))
