"""Every rank of a group issues the same collectives, in the same order, every step, for every schedule a device
uses: spawned gloo ranks run ModelRunners under a collective recording whose store check compares each call with
the other ranks before it runs (so a disagreement fails fast, naming the call, instead of hanging), and the test
compares the returned traces again (carrier of each exchange, pairing of variable splits).

Covered: EXTEND and DECODE two-batch overlap with the ``coarse`` (CPU default) and ``fine`` (CUDA default, forced
here) decode schedules, IDLE groups beside DECODE and EXTEND groups, MIXED steps (no TBO), low-latency and normal
all-to-all, single-batch overlap, decode graphs (CPU recordings, with and without TBO, IDLE groups replaying
padding), tensor parallelism (TP all-reduce / all-gather), on Qwen3-MoE and DeepSeek-V3 (MLA, shared experts, a
dense first layer). The decisions come from the driver's planning functions (``tests/trace_scenarios.py``).
"""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from trace_scenarios import IDLE, disagreeing_ranks, traced_scenario

from raymoe.comm.trace_compare import check_step_traces
from raymoe.config import GraphConfig, MoeCommConfig, OverlapConfig, ParallelConfig
from raymoe.models.checkpoint import make_checkpoint

NO_GRAPHS = GraphConfig(disable_cuda_graph=True)
TBO = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}
RUNNERS = {
    "plain": {"graph": NO_GRAPHS},  # a2a auto: low-latency decode steps, normal extend steps
    "normal_a2a": {"graph": NO_GRAPHS, "moe_comm": MoeCommConfig(a2a_mode="normal")},
    "sbo": {"graph": NO_GRAPHS, "overlap": OverlapConfig(enable_sbo=True)},
    "tbo_coarse": {"graph": NO_GRAPHS, "overlap": OverlapConfig(**TBO)},  # auto: coarse on CPU
    "tbo_fine": {"graph": NO_GRAPHS, "overlap": OverlapConfig(**TBO, tbo_decode_schedule="fine")},
    "graphs_tbo_fine": {"graph": GraphConfig(), "overlap": OverlapConfig(**TBO, tbo_decode_schedule="fine")},
}
# Per step one spec per DP group (tests/trace_scenarios.py).
STEPS = [
    (("extend", {0: 6, 1: 5, 2: 11}), ("extend", {0: 4, 1: 11, 2: 12})),  # EXTEND TBO (group 1: two-chunk split)
    (("decode", [0, 1, 2]), ("decode", [0, 1])),                          # DECODE TBO, graph bucket 4
    (("decode", [0, 1, 2]), IDLE),                                        # DECODE TBO beside an IDLE group
    (("extend", {3: 7}), IDLE),                                           # EXTEND beside IDLE: no TBO
    (("mixed", {4: 5, 0: 1, 1: 1, 2: 1}), ("decode", [0, 1, 2])),         # MIXED: no TBO, normal mode
    (IDLE, ("decode", [0, 1, 2])),                                        # IDLE group replays padding rows
    (("decode", [0, 1, 2, 3, 4]), ("decode", [1, 2])),                    # bucket 8
    (("decode", [0]), ("decode", [2])),                                   # one row each: no TBO, bucket 1
]
DS_DIMS = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
           "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 2048}


def _check_all(per_rank: list[dict], tp_size: int = 1) -> None:
    """Every runner's construction and steps agree across ranks (``check_step_traces``), and nothing is empty."""
    for name in per_rank[0]:
        check_step_traces([r[name]["build"] for r in per_rank], tp_size, step=f"{name}/build")
        for i in range(len(per_rank[0][name]["steps"])):
            traces = [r[name]["steps"][i]["trace"] for r in per_rank]
            assert all(traces), (name, i)  # every step exchanges something, IDLE ranks included
            check_step_traces(traces, tp_size, step=f"{name}/{i}")


def _ops(result: dict, step: int) -> set[str]:
    return {c.op for c in result["steps"][step]["trace"]}


def _children(result: dict, step: int) -> list:
    return [c.child for c in result["steps"][step]["trace"] if c.group == "ep"]


def _check_coverage(rank0: dict) -> None:
    plans = [s["plan"] for s in rank0["tbo_fine"]["steps"]]
    assert [p["use_tbo"] for p in plans] == [True, True, True, False, False, True, True, False]
    assert plans[2]["modes"] == ("DECODE", "IDLE") and plans[4]["modes"] == ("MIXED", "DECODE")
    assert {0, 1} <= set(_children(rank0["tbo_fine"], 2))  # both children's exchanges, IDLE step included
    # The schedules differ where they should, so agreement of each is not agreement by accident.
    assert _children(rank0["tbo_fine"], 1) != _children(rank0["tbo_coarse"], 1)
    assert _children(rank0["tbo_fine"], 0) == _children(rank0["tbo_coarse"], 0)  # EXTEND: one schedule
    low_latency, normal = {"all_gather", "all_to_all_equal"}, {"exchange_counts", "all_to_all_rows"}
    assert rank0["plain"]["steps"][1]["plan"]["capacity"] is not None and low_latency <= _ops(rank0["plain"], 1)
    assert normal <= _ops(rank0["plain"], 0) and normal <= _ops(rank0["plain"], 4)
    assert rank0["normal_a2a"]["steps"][1]["plan"]["capacity"] is None and normal <= _ops(rank0["normal_a2a"], 1)
    graphs = [s["plan"] for s in rank0["graphs_tbo_fine"]["steps"]]
    assert [p["graph_bs"] for p in graphs] == [None, 4, 4, None, None, 4, 8, 1]
    assert rank0["graphs_tbo_fine"]["build"]  # the capture exchanged too (and agreed)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    return str(make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds") / "v3", seed=2, **DS_DIMS))


def test_qwen3_ranks_agree_on_every_schedule_dp2_ep2(tiny_model):
    per_rank = run_ranks(traced_scenario, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), tiny_model, RUNNERS, STEPS)
    _check_all(per_rank)
    _check_coverage(per_rank[0])


def test_deepseek_ranks_agree_on_every_schedule_dp2_ep2(deepseek):
    runners = {k: RUNNERS[k] for k in ("plain", "tbo_coarse", "tbo_fine", "graphs_tbo_fine")}
    per_rank = run_ranks(traced_scenario, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), deepseek, runners, STEPS)
    _check_all(per_rank)
    assert {0, 1} <= set(_children(per_rank[1]["tbo_fine"], 2))  # rank 1 is the IDLE one at step 2


def test_tp2_ranks_agree_and_record_tp_collectives(tiny_model):
    steps = [(("extend", {0: 6, 1: 9}),), (("decode", [0, 1]),), (("mixed", {2: 4, 0: 1, 1: 1}),),
             (("decode", [0, 1, 2]),)]
    runners = {k: RUNNERS[k] for k in ("plain", "tbo_fine")}
    per_rank = run_ranks(traced_scenario, ParallelConfig(tp_size=2, dp_size=1, ep_size=2), tiny_model, runners,
                         steps)
    _check_all(per_rank, tp_size=2)
    for name in runners:
        for step in per_rank[0][name]["steps"]:
            assert {"all_reduce", "all_gather"} <= {c.op for c in step["trace"] if c.group == "tp"}, name
    assert [s["plan"]["use_tbo"] for s in per_rank[0]["tbo_fine"]["steps"]] == [True, True, False, True]


def test_a_rank_on_another_schedule_or_skipping_a_collective_fails_fast_naming_the_call(tiny_model):
    """Rank 1 skips a ``torch.distributed`` all-reduce; then it runs every TBO batch with the EXTEND schedule while
    rank 0 runs DECODE ``fine``: both ranks raise at the first differing call, before running it (the harness's
    timeout only bounds progress; a hang would exceed it)."""
    spec = RUNNERS["tbo_fine"]
    steps = STEPS[:2]
    per_rank = run_ranks(disagreeing_ranks, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), tiny_model, spec,
                         steps, timeout_s=180)
    skip0, skip1 = per_rank[0]["skip"], per_rank[1]["skip"]
    assert (skip0["group"], skip0["index"], skip0["rank"]) == ("world", 0, 1)
    assert skip0["mine"].startswith("world all_reduce shapes=[(3,)]") and skip0["theirs"].startswith("world barrier")
    assert (skip1["mine"], skip1["theirs"]) == (skip0["theirs"], skip0["mine"])
    assert "rank 0 issues world all_reduce" in skip0["message"] and "rank 1 issues world barrier" in skip0["message"]
    s0, s1 = per_rank[0]["schedule"], per_rank[1]["schedule"]
    assert s0 is not None and s1 is not None, per_rank
    assert per_rank[0]["plans"][1]["use_tbo"] and s0["step"] == s1["step"] == 2  # step 0: construction
    assert (s0["group"], s0["index"]) == (s1["group"], s1["index"]) == ("ep", s0["index"])
    assert s0["mine"] == s1["theirs"] and s0["theirs"] == s1["mine"] and s0["mine"] != s0["theirs"]
    assert "child=" in s0["mine"] and "SparseMoeBlock" in s0["mine"] + s0["theirs"]
