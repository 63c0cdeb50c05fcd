"""Start-up bounds of an engine's ranks (declarations: ``raymoe.config.option``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from raymoe.config.option import option
from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class StartupConfig:
    """How long each stage of the ranks' start-up may take before it fails (``raymoe.actors.rank_startup``); each
    field's help says what it bounds. The front end waits for the driver as long as the stages together
    (``raymoe.actors.startup_budget``).

    Raises:
        InvalidRequestError: a bound that is not a positive, finite number of seconds (names the field).
    """

    placement_timeout_s: float = option(
        180.0, help="seconds the ranks' placement groups may wait for room on the Ray cluster (an autoscaler adds "
                    "nodes meanwhile); past it start-up fails naming the bundles it could not place.")
    load_timeout_s: float | None = option(
        None, help="seconds each rank may take, once placed, to load its weights and capture its decode graphs (the "
                   "two stages together). None: derived from the checkpoint's weight bytes per rank and the number "
                   "of decode graphs (raymoe.actors.startup_budget: generous, so that it only catches a hung start).")

    def __post_init__(self) -> None:
        for name in ("placement_timeout_s", "load_timeout_s"):
            v = getattr(self, name)
            if v is None and name == "load_timeout_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise InvalidRequestError(name, f"must be a positive number of seconds, got {v!r}")
