"""Whether a step should verify drafts, and how many per request: only those expected to pay for themselves.

Two costs are fitted online, each ``a + b * T`` seconds for ``T`` tokens, by least squares with exponential
forgetting over the group's steps (``StepOutput.forward_seconds`` against their token counts): plain DECODE steps
(on a platform with decode graphs these replay a captured graph) and TARGET_VERIFY steps (eager, extend-style
attention). With ``bs`` decoding requests, plain decoding costs ``c = C_decode(bs) / bs`` per token. The ``j``-th
draft token of a request adds ``b_verify`` seconds and is worth a token exactly when it and the ``j - 1`` drafts
before it are accepted; with a per-draft acceptance probability ``p`` (taken as independent) it pays when
``p ** j * c > b_verify``. A step then verifies only if its expected tokens per second beat plain decoding's:
``sum_i (1 + sum_j p_i ** j) / C_verify(bs + drafts) > bs / C_decode(bs)``; otherwise it runs as plain DECODE. So
at batch 1 on a step-overhead-bound machine almost any draft pays, and on a compute-bound batch only sure drafts
do, or none.

``p`` is estimated per request from its own verify rows, starting from the group's overall acceptance. A request
that drafts nothing still verifies one draft every ``PROBE_EVERY`` steps, and a decision that went the same way
``EXPLORE_EVERY`` times in a row is flipped, so both costs and every acceptance stay measured (steps formed under
overlap scheduling, which look for no drafts, count as decisions for plain decoding: ``skip_step``). Only runs are
flipped, never a decision that ends a run of the other kind: the look that follows a long overlapped stretch of
plain steps keeps the fits' choice (were it flipped into plain decoding, its overlap back-off would make the next
look a flip again, and drafts that pay would never be verified). Before a cost has data the step verifies.
This is the engine's own rule (SGLang and vLLM take a fixed draft length; vLLM can switch speculation off above a
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
EXPLORE_EVERY = 64
"""After this many step decisions in a row went the same way the next one is flipped (a verify step where decoding
was chosen, or the reverse), so the cost not chosen stays measured; rare, because a forced verify step at a
compute-bound batch costs several decode steps."""


class StepCost:
    """A step cost ``a + b * tokens`` seconds fitted by least squares with exponential forgetting (``FORGET``)."""

    def __init__(self) -> None:
        self._s = [0.0] * 5  # forgetting sums: weight, x, y, x*x, x*y (x = tokens, y = seconds)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step of ``num_tokens`` tokens that took ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        x, y = float(num_tokens), float(seconds)
        s = self._s
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = s[i] * FORGET + v

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per step and per token (None: no two distinct token counts seen yet)."""
        w, sx, sy, sxx, sxy = self._s
        det = w * sxx - sx * sx
        if w <= 0 or det <= 1e-9 * max(w * sxx, 1e-30):
            return None
        b = (w * sxy - sx * sy) / det
        return max((sy - b * sx) / w, 0.0), max(b, 0.0)

    def at(self, num_tokens: int) -> float | None:
        """Predicted seconds of a step of ``num_tokens`` tokens: the fit, or the mean step time while every step
        seen had about the same token count; None before any step."""
        w = self._s[0]
        if w <= 0:
            return None
        fit = self.fit()
        if fit is None:
            return self._s[2] / w
        return fit[0] + fit[1] * num_tokens


@dataclass
class _Acceptance:
    accepted: float
    trials: float
    skipped: int = 0


class DraftPolicy:
    """Draft lengths from a fitted step cost and each request's acceptance (module docstring)."""

    def __init__(self) -> None:
        self.decode_cost = StepCost()
        self.verify_cost = StepCost()
        self._plain_run = 0  # decisions for plain decoding (overlapped steps included) since the last verify one
        self._verify_run = 0  # verify decisions since the last plain one
        self.explored = False
        """Whether the last :meth:`worth_verifying` answer was a flipped one (exploration, not the fits' choice)."""
        self._reqs: dict[str, _Acceptance] = {}
        self._accepted = 0
        self._trials = 0

    # ------------------------------------------------------------------ step cost
    def observe_step(self, verify: bool, num_tokens: int, seconds: float) -> None:
        """Record one DECODE (``verify`` False) or TARGET_VERIFY step: ``num_tokens`` tokens in ``seconds``."""
        (self.verify_cost if verify else self.decode_cost).observe(num_tokens, seconds)

    def per_token_decode_cost(self, batch_size: int) -> float | None:
        """Seconds per token of a plain decode step of ``batch_size`` rows (the verify fit stands in before the
        decode fit has data); None before any data."""
        cost = self.decode_cost.at(batch_size)
        if cost is None:
            cost = self.verify_cost.at(batch_size)
        return None if cost is None else cost / batch_size

    def threshold(self, batch_size: int) -> float:
        """The least ``p ** j`` a ``j``-th draft token needs in a step of ``batch_size`` rows (0 before a fit)."""
        c = self.per_token_decode_cost(batch_size)
        fit = self.verify_cost.fit()
        if c is None or fit is None or c <= 0:
            return 0.0
        return min(fit[1] / c, 1.0)

    def worth_verifying(self, rows: list[tuple[str, int]], batch_size: int) -> bool:
        """Whether a verify step of ``rows`` (``(rid, draft tokens)``, one per decoding request) is expected to
        give more tokens per second than a plain decode step of ``batch_size`` rows (module docstring)."""
        drafts = sum(n for _, n in rows)
        c_verify = self.verify_cost.at(batch_size + drafts)
        c_decode = self.decode_cost.at(batch_size)
        if c_verify is None or c_decode is None:
            choice = True
        else:
            expected = 0.0
            for rid, n in rows:
                p, term = self.acceptance(rid), 1.0
                expected += 1.0
                for _ in range(n):
                    term *= p
                    expected += term
            choice = expected / c_verify > batch_size / c_decode
        return self._flip_runs(choice)

    def _flip_runs(self, choice: bool) -> bool:
        """``choice``, flipped when the same choice was made ``EXPLORE_EVERY`` times in a row (the other cost is
        re-measured). Only a run of one kind is flipped: a verify decision after a run of plain steps is kept, so
        a long overlapped stretch of plain decoding never ends in a forced plain step where drafts pay."""
        self.explored = False
        if choice:
            self._verify_run, self._plain_run = self._verify_run + 1, 0
            if self._verify_run >= EXPLORE_EVERY:
                self._verify_run, self.explored = 0, True
                return False
            return True
        self._plain_run, self._verify_run = self._plain_run + 1, 0
        if self._plain_run >= EXPLORE_EVERY:
            self._plain_run, self.explored = 0, True
            return True
        return False

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

    def skip_step(self, rids: list[str]) -> None:
        """A decode step formed without a look for drafts (overlap scheduling formed it with its requests' tokens
        pending): it counts toward the next flipped decision and each request's next probe, as a step that chose
        plain decoding would."""
        self._plain_run, self._verify_run = self._plain_run + 1, 0
        for rid in rids:
            self._reqs.setdefault(rid, _Acceptance(0.0, 0.0)).skipped += 1

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
