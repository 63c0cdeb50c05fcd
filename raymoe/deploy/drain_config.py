"""DrainConfig: how the HTTP front end drains on a stop (``raymoe.deploy.drain`` does it).

A light module (no web framework): ``raymoe serve``'s flags are built from it, and the ``raymoe`` command line (its
``env`` and ``bench`` subcommands too) imports it on machines that have no web stack installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.config.option import option
from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class DrainConfig:
    """How a front end drains (each field's help says what it bounds; ``raymoe serve`` has a flag per field).

    Raises:
        InvalidRequestError: a field out of range (names it).
    """

    shutdown_timeout_s: float = option(
        30.0, flag="shutdown-timeout",
        help="on SIGTERM / Ctrl-C, how long the requests in flight may take to finish before they are ended with a "
             "server_shutdown error event, seconds (Kubernetes' default grace period is 30 s).")
    cut_grace_s: float = option(
        5.0, help="after the shutdown timeout, how long the cut requests may take to write their last event, "
                  "seconds.")
    retry_after_s: int = option(
        5, help="Retry-After of a request refused while the server drains, seconds (by then a load balancer "
                "polling readiness every few seconds has taken the server out).")

    def __post_init__(self) -> None:
        for name in ("shutdown_timeout_s", "cut_grace_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 86_400:
                raise InvalidRequestError(name, f"must be a number of seconds in (0, 86400], got {v!r}")
        v = self.retry_after_s
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 3600:
            raise InvalidRequestError("retry_after_s", f"must be an integer number of seconds in [0, 3600], got {v!r}")
