"""How long engine steps take, by kind of step: the driver's step period and the ranks' own forward time.

Two figures per collected step, kept as cumulative histograms for ``/metrics``
(``raymoe:engine_step_period_seconds`` and ``raymoe:engine_step_forward_seconds``, label ``mode``):

* the **period**: wall time the step held the ranks as the driver sees it, ``collect - max(previous collect,
  launch)``. With overlap scheduling the next step is queued before the current one is collected, so while work
  lasts this is the time between consecutive collections (what a decoding stream waits per token); after an idle
  spell, or without overlap scheduling, it is the step's own launch-to-collect time. Idle time is never counted.
* the **forward**: forward + sampling seconds measured on the ranks (``StepOutput.forward_seconds``), the slowest
  DP group's.

The difference is what the step cost outside the model: fan-out, the driver's share of the CPU, and ranks kept
waiting for the next step. On the 2-core benchmark machine a served dp=2 ep=2 decode step's period was its ranks'
forward plus 0.2-0.3 ms, while that forward took 1.1-2.1x its offline time: the ranks were short of CPU, not
waiting for the driver (read from these histograms: period / forward 5.52 / 5.21 and 4.08 / 3.90 ms in two
runs).

``mode`` is ``"decode"`` when every DP group decoded (or idled), ``"mixed"`` when some group ran a MIXED batch
(prompt chunks beside decodes), ``"verify"`` when the groups verified speculative drafts (TARGET_VERIFY beside
decodes or IDLE groups), else ``"extend"`` (prefill only). Owned by the ``Driver``; read through
``EngineStats.step_times``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raymoe.step.forward_mode import ForwardMode

STEP_MODES = ("decode", "mixed", "extend", "verify")

# Upper bounds of the histogram buckets, seconds (a last bucket, +Inf, holds the rest): a CPU decode step of the
# tiny models takes 2-10 ms, a GPU one a few ms, a long prefill up to seconds.
STEP_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                                     0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


def step_mode(modes: Sequence[ForwardMode]) -> str:
    """The ``mode`` label of a step whose DP groups ran ``modes`` (one per group).

    Raises:
        ValueError: ``modes`` is empty.
    """
    if not modes:
        raise ValueError("a step has at least one DP group")
    if all(m.is_decode_or_idle() for m in modes):
        return "decode"
    if all(m.is_decode_or_idle() or m.is_target_verify() for m in modes):
        return "verify"
    return "mixed" if any(m == ForwardMode.MIXED for m in modes) else "extend"


@dataclass(frozen=True)
class Histogram:
    """One cumulative histogram over :data:`STEP_BUCKETS_S`.

    Attributes:
        counts: observations per bucket (not cumulative), ``len(STEP_BUCKETS_S) + 1`` entries, the last one +Inf.
        total: sum of the observations, seconds.
    """

    counts: tuple[int, ...]
    total: float

    def __post_init__(self) -> None:
        if len(self.counts) != len(STEP_BUCKETS_S) + 1:
            raise ValueError(f"a step histogram has {len(STEP_BUCKETS_S) + 1} buckets, got {len(self.counts)}")

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: ``(le, observations <= le)`` pairs, the last ``("+Inf", count)``."""
        out, running = [], 0
        for le, n in zip((*map(str, STEP_BUCKETS_S), "+Inf"), self.counts, strict=True):
            running += n
            out.append((le, running))
        return out


@dataclass(frozen=True)
class StepTimes:
    """A snapshot of :class:`StepTimer`: per mode, the period and forward histograms (plain data, picklable)."""

    period: dict[str, Histogram]
    forward: dict[str, Histogram]


class StepTimer:
    """Accumulates the period and forward time of each collected step (see the module docstring).

    Args:
        clock: monotonic clock in seconds (tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._last_collect: float | None = None
        n = len(STEP_BUCKETS_S) + 1
        self._period = {m: [0] * n for m in STEP_MODES}
        self._forward = {m: [0] * n for m in STEP_MODES}
        self._period_sum = dict.fromkeys(STEP_MODES, 0.0)
        self._forward_sum = dict.fromkeys(STEP_MODES, 0.0)

    def collected(self, mode: str, launched_at: float, forward_seconds: float) -> float:
        """Record a step collected now: launched at ``launched_at`` (``clock`` seconds), its ranks' forward took
        ``forward_seconds``. Returns the period recorded, seconds.

        Raises:
            KeyError: ``mode`` is not one of :data:`STEP_MODES`.
        """
        now = self.clock()
        start = launched_at if self._last_collect is None else max(self._last_collect, launched_at)
        self._last_collect = now
        period = max(0.0, now - start)
        for hist, sums, value in ((self._period, self._period_sum, period),
                                  (self._forward, self._forward_sum, max(0.0, forward_seconds))):
            hist[mode][bisect.bisect_left(STEP_BUCKETS_S, value)] += 1
            sums[mode] += value
        return period

    def snapshot(self) -> StepTimes:
        """The histograms so far (copies)."""
        return StepTimes(
            period={m: Histogram(tuple(self._period[m]), self._period_sum[m]) for m in STEP_MODES},
            forward={m: Histogram(tuple(self._forward[m]), self._forward_sum[m]) for m in STEP_MODES})
