"""How many draft tokens a request should verify this step: only those expected to pay for themselves.

A verify step costs the ranks about ``a + b * T`` seconds for ``T`` tokens (a fixed part: the layers' launches, the
collectives, the driver's round trip; a per-token part: the GEMMs). A plain decode step of ``bs`` requests costs
``a + b * bs`` for ``bs`` tokens, ``c = (a + b * bs) / bs`` per token. The ``j``-th draft token of a request adds
``b`` seconds and is worth one token exactly when the ``j - 1`` drafts before it and itself are accepted; with a
per-draft acceptance probability ``p`` (taken as independent) it pays when ``p ** j * c > b``, i.e.
``p ** j > b * bs / (a + b * bs)``. So at batch 1 on a step-overhead-bound machine almost any draft pays, and on a
compute-bound batch only drafts that are nearly sure do; a request whose drafts keep failing stops drafting
(except a one-token probe every ``PROBE_EVERY`` steps, so it notices when its text starts to repeat).

``a`` and ``b`` are fitted online, by least squares with exponential forgetting over the group's decode and verify
steps (``StepOutput.forward_seconds`` against their token counts); ``p`` per request from its own verify rows,
starting from the group's overall acceptance. Before the fit has two distinct token counts every draft is taken.
This is the engine's own rule (SGLang and vLLM take a fixed draft length, vLLM can switch speculation off above a
batch size); it is what makes ``speculative_algorithm`` safe to leave on.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

FORGET = 0.97
"""Weight kept by older step timings at each new one (about the last 30 steps count)."""
DECAY = 0.8
"""Weight kept by a request's older acceptance outcomes at each of its verify rows."""
PROBE_EVERY = 16
"""A request that drafts nothing still verifies one draft token this often, steps."""


@dataclass
class _Acceptance:
    accepted: float
    trials: float
    skipped: int = 0


class DraftPolicy:
    """Draft lengths from a fitted step cost and each request's acceptance (module docstring)."""

    def __init__(self) -> None:
        self._s = [0.0] * 5  # forgetting sums: weight, x, y, x*x, x*y (x = tokens, y = seconds)
        self._reqs: dict[str, _Acceptance] = {}
        self._accepted = 0
        self._trials = 0

    # ------------------------------------------------------------------ step cost
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Record one decode or verify step: ``num_tokens`` tokens in ``seconds`` on the ranks."""
        if num_tokens <= 0 or seconds <= 0:
            return
        x, y = float(num_tokens), float(seconds)
        s = self._s
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = s[i] * FORGET + v

    def step_cost(self) -> tuple[float, float] | None:
        """The fitted ``(a, b)``: fixed seconds per step and seconds per token (None: not enough distinct data)."""
        w, sx, sy, sxx, sxy = self._s
        det = w * sxx - sx * sx
        if w <= 0 or det <= 1e-9 * max(w * sxx, 1e-30):
            return None
        b = (w * sxy - sx * sy) / det
        a = (sy - b * sx) / w
        return max(a, 0.0), max(b, 0.0)

    def threshold(self, batch_size: int) -> float:
        """The least ``p ** j`` a ``j``-th draft token needs in a step of ``batch_size`` rows (0 before a fit)."""
        cost = self.step_cost()
        if cost is None:
            return 0.0
        a, b = cost
        total = a + b * batch_size
        return b * batch_size / total if total > 0 else 0.0

    # ------------------------------------------------------------------ acceptance
    def acceptance(self, rid: str) -> float:
        """``rid``'s estimated per-draft acceptance probability."""
        r = self._reqs.get(rid)
        prior = (self._accepted + 1) / (self._trials + 2)
        if r is None:
            return prior
        return (r.accepted + prior) / (r.trials + 1)

    def observe_row(self, rid: str, drafts: int, accepted: int) -> None:
        """A verify row of ``rid`` with ``drafts`` draft tokens accepted ``accepted`` of them (a chain: the trials
        are the accepted ones and the first rejected one)."""
        if drafts <= 0:
            return
        trials = accepted + (accepted < drafts)
        r = self._reqs.setdefault(rid, _Acceptance(0.0, 0.0))
        r.accepted = r.accepted * DECAY + accepted
        r.trials = r.trials * DECAY + trials
        self._accepted += accepted
        self._trials += trials

    def forget(self, rid: str) -> None:
        """``rid`` finished or left the group."""
        self._reqs.pop(rid, None)

    def prune(self, live: Container[str]) -> None:
        """Forget requests not in ``live`` (those that ended outside a verify row), once they outnumber it."""
        if len(self._reqs) > 2 * len(live) + 64:
            for rid in [rid for rid in self._reqs if rid not in live]:
                del self._reqs[rid]

    def draft_len(self, rid: str, max_len: int, batch_size: int) -> int:
        """Draft tokens worth verifying for ``rid`` (``0 .. max_len``) in a step of ``batch_size`` rows."""
        if max_len <= 0:
            return 0
        p, need = self.acceptance(rid), self.threshold(batch_size)
        j, expect = 0, 1.0
        while j < max_len:
            expect *= p
            if expect <= need:
                break
            j += 1
        r = self._reqs.setdefault(rid, _Acceptance(0.0, 0.0))
        if j:
            r.skipped = 0
            return j
        r.skipped += 1
        if r.skipped >= PROBE_EVERY:
            r.skipped = 0
            return 1
        return 0
