"""``raymoe bench overlap`` runs its rank code on two gloo ranks in every dispatch mode.

The bench wraps each MoE block's dispatcher (``BenchAllToAll``) to record what a real dispatch delivered and to
replay it without communication (``loopback``), so it must know every layout a dispatcher can answer; a layout it
does not know fails the run. A tiny model's decode steps take the token-row layout (``RoutedTokenRows``) in the
low-latency mode and sorted pairs (``ExpertRows``) in the normal mode.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from raymoe.config import ParallelConfig

sys.path.insert(0, str(Path(__file__).parent))

TIMES = ("compute_ms", "tbo_compute_ms", "comm_ms", "serial_ms", "tbo_ms", "sbo_ms")


@pytest.mark.parametrize("a2a_mode", ["normal", "low_latency"])
def test_overlap_bench_points(tiny_model, a2a_mode):
    from dist_harness import run_ranks

    from raymoe.bench.overlap import add_efficiency, format_table
    from raymoe.bench.overlap_rank import measure_rank

    per_rank = run_ranks(measure_rank, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), tiny_model, [6], [0.0, 0.5],
                         8, 0, 2, 0, a2a_mode)
    assert per_rank[1] is None
    points = add_efficiency(per_rank[0])
    assert [(p["batch_size"], p["latency_ms"], p["a2a_mode"]) for p in points] == [(6, 0.0, a2a_mode),
                                                                                   (6, 0.5, a2a_mode)]
    for p in points:
        assert p["tbo_same_tokens"] is True
        for key in TIMES:
            assert 0.0 < p[key] < 60_000.0 and 0.0 < p[key.removesuffix("_ms") + "_min_ms"] <= p[key]
        assert math.isfinite(p["efficiency"]) and p["tbo_latency_exposed"] >= 0.0
    assert len(format_table(points).splitlines()) == 3
