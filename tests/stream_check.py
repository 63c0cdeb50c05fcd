"""Checks that concurrent streams got their own tokens, and a fault injector that swaps two streams' tokens.

Counting tokens or finish reasons cannot tell streams apart: tokens delivered to the wrong stream of the same
length pass such a check. Here each stream's output is compared with its own reference, the same request run
undisturbed (alone, or in a small batch of a deterministic engine: greedy, or sampling with a per-request seed)
through the same engine. :class:`SwapTwoStreams` stands in for a routing bug of the front end, to show the check
catches one (tests/test_server_api.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import replace


def assert_distinct(want: Mapping[Hashable, str], min_fraction: float = 1.0) -> None:
    """At least ``min_fraction`` of the references differ from every other one, so that a swap between streams
    shows (a check against references that are all alike proves nothing).

    Raises:
        AssertionError: too many references equal another one.
    """
    counts: dict[str, int] = {}
    for text in want.values():
        counts[text] = counts.get(text, 0) + 1
    unique = sum(1 for text in want.values() if counts[text] == 1)
    assert unique >= min_fraction * len(want), f"only {unique} of {len(want)} references are unique"


def assert_own_outputs(got: Mapping[Hashable, str], want: Mapping[Hashable, str], prefix_ok: bool = False) -> None:
    """Every stream's output equals its own reference (``prefix_ok``: is a prefix of it, for streams cut short by
    a hang-up or a fault).

    Args:
        got: stream key -> the text it received (streams missing from ``got`` are not checked).
        want: stream key -> its reference text.
    Raises:
        AssertionError: naming each stream that got something else, and which other stream's reference its output
            is, when it is one (a mix-up).
    """
    bad = {}
    for key, text in got.items():
        ref = want[key]
        if text == ref or (prefix_ok and ref.startswith(text)):
            continue
        owners = [k for k, w in want.items() if k != key and w == text]
        bad[key] = f"got {text[:60]!r}, want {ref[:60]!r}" + (f" (the output of {owners[:3]})" if owners else "")
    assert not bad, f"{len(bad)} of {len(got)} streams got other tokens than their own: " + "; ".join(
        f"{k}: {v}" for k, v in list(bad.items())[:5])


class SwapTwoStreams:
    """A stand-in for ``raymoe.client.engine_client._deliver`` that exchanges the tokens of two requests.

    The first delivery that carries tokens for two requests picks them (lowest request ids); from then on, in every
    delivery that carries both, each gets the other's ``token_ids`` and ``logprobs`` (finish flags and usage stay),
    so the streams keep their lengths and finish reasons: only their tokens are wrong.

    Args:
        deliver: the real ``_deliver`` (called with the altered items).
    Attributes:
        pair: the two request ids, once picked. swaps: deliveries in which they were exchanged.
    """

    def __init__(self, deliver):
        self.deliver = deliver
        self.pair: tuple[str, str] | None = None
        self.swaps = 0

    def __call__(self, items: list) -> None:
        where = {delta.request_id: k for k, (_, delta) in enumerate(items) if delta.token_ids}
        if self.pair is None and len(where) >= 2:
            a, b = sorted(where)[:2]
            self.pair = (a, b)
        if self.pair is not None and all(r in where for r in self.pair):
            i, j = (where[r] for r in self.pair)
            (qi, di), (qj, dj) = items[i], items[j]
            items = list(items)
            items[i] = (qi, replace(di, token_ids=dj.token_ids, logprobs=dj.logprobs))
            items[j] = (qj, replace(dj, token_ids=di.token_ids, logprobs=di.logprobs))
            self.swaps += 1
        self.deliver(items)
