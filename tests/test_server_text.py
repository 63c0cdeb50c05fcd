"""Streamed text of the HTTP front end: incremental detokenization and stop-string hold-back (no engine)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raymoe.deploy.detokenizer import IncrementalDetokenizer, StopStringFilter
from raymoe.deploy.http_errors import from_raymoe_error
from raymoe.errors import EngineUnhealthyError, InvalidRequestError


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from raymoe.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def _chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_streamed_text_equals_full_decode(tokenizer, text, cuts):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = _chunks(ids, cuts)
    out = "".join(detok.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
    assert out == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_character_is_never_split(tokenizer):
    ids = tokenizer.encode("é世🎉", add_special_tokens=False)
    assert len(ids) > 3, "byte-level tokens: each of these characters spans several tokens"
    detok = IncrementalDetokenizer(tokenizer)
    shown = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in s for s in shown)
    assert "".join(shown) == "é世🎉"


def _reference_cut(text: str, stop: list[str]) -> str:
    """What a client must see: the text up to the first stop string to complete, cut before it."""
    for end in range(len(text) + 1):
        hits = [text[:end].find(s) for s in stop if s in text[:end]]
        if hits:
            return text[:min(hits)]
    return text


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=30), stop=st.lists(st.text(alphabet="abc\n", min_size=1,
                                                                            max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=10))
def test_stop_filter_never_shows_part_of_a_stop_string(text, stop, cuts):
    f = StopStringFilter(stop)
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    shown = ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        shown += f.push(text[a:b], final=b == len(text))
        # Nothing shown so far may end inside a stop string that the rest of the text completes.
        assert _reference_cut(text, stop).startswith(shown)
    assert shown == _reference_cut(text, stop)
    assert (f.matched is not None) == any(s in text for s in stop)


def test_stop_filter_holds_a_prefix_until_it_is_decided():
    f = StopStringFilter(["STOP"])
    assert f.push("abc ST") == "abc "
    assert f.push("O") == ""
    assert f.push("X more") == "STOX more"
    assert f.push(" and STOP here") == " and "
    assert f.matched == "STOP" and f.push("tail") == ""


def test_engine_errors_map_to_statuses():
    assert from_raymoe_error(InvalidRequestError("queue", "full")).status == 429
    bad = from_raymoe_error(InvalidRequestError("temperature", "must be >= 0"))
    assert bad.status == 400 and bad.body()["error"]["param"] == "temperature"
    assert from_raymoe_error(EngineUnhealthyError("rank 1 died")).status == 503
    assert from_raymoe_error(RuntimeError("boom")).status == 500
