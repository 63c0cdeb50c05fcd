"""Start-up progress lines of an engine's ranks, and waiting on every rank with a bound.

The lines are written by the process that starts the ranks: the driver actor of a served engine (its stderr
reaches the ``raymoe serve`` console through Ray's log forwarding, ``ray.init(log_to_driver=True)``, prefixed
``(DriverActor pid=...)``; a Serve app's replica logs them the same way) or the offline ``Engine``'s process.
A progress record polled by the front end was not used: the driver actor answers no call until its constructor,
which starts the ranks, has returned.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

PREFIX = "raymoe start-up:"
REPORT_EVERY_S = 30.0
"""While a stage waits on slow ranks, a line every this many seconds says how many have finished."""

Progress = Callable[[str], None]


def console_progress(line: str) -> None:
    """Write one progress line to stderr, flushed (so Ray forwards it at once)."""
    print(f"{PREFIX} {line}", file=sys.stderr, flush=True)


def wait_all(refs: Sequence[Any], timeout_s: float, stage: str, progress: Progress | None,
             option: str, every_s: float = REPORT_EVERY_S) -> list[Any]:
    """The results of every rank's call ``refs`` (Ray object refs), waiting at most ``timeout_s`` seconds; the
    first rank that raises fails the stage at once.

    Args:
        stage: what the ranks do, for the lines and the error (``"loading weights"``).
        option: the option that sets ``timeout_s``, named in the error.
        every_s: seconds between "k of n ranks" lines while waiting.
    Raises:
        TimeoutError: ranks still busy at the bound (how many, the bound, the option).
        Exception: whatever the first failing rank raised (``RayTaskError`` / ``RayActorError``).
    """
    import ray

    t0 = time.monotonic()
    deadline, next_report = t0 + timeout_s, t0 + every_s
    pending = list(refs)
    while pending:
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"{stage}: {len(pending)} of {len(refs)} rank(s) still busy after {timeout_s:.0f} s "
                               f"(the bound is {option})")
        if progress is not None and now >= next_report:
            progress(f"{stage}: {len(refs) - len(pending)} of {len(refs)} rank(s) done after {now - t0:.0f} s "
                     f"(bound {timeout_s:.0f} s)")
            next_report = now + every_s
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(deadline - now, 1.0))
        for r in ready:
            ray.get(r)  # raises the rank's error at once
    return ray.get(list(refs))


def root_cause(e: BaseException) -> str:
    """``"Type: message"`` of the error a rank raised, unwrapped from Ray's task error (its ``cause``: a rank's
    ``RankDeviceError`` reads as itself, not as Ray's wrapper with the remote traceback)."""
    cause = getattr(e, "cause", None)
    while isinstance(cause, BaseException) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    err = cause if isinstance(cause, BaseException) else e
    return f"{type(err).__name__}: {err}"
