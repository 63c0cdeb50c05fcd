"""Randomized agreement of the driver's step-wide decisions: random multi-group workloads (arrivals, aborts, EOS,
retraction under a small KV pool, chunk sizes, idle groups, TBO, graphs, a2a modes, MIXED batches, overlap
scheduling and the radix cache on and off) run through the real ``Driver`` and its schedulers with a fake executor
that checks every step it is sent (``tests/step_decisions.py``: all groups got the same ``use_tbo``, ``graph_bs``,
``dispatch_capacity`` and ``global_num_tokens``, and those agree with the batches). Hypothesis reports the failing
workload, and its seed with ``--hypothesis-seed`` / ``@reproduce_failure`` (``print_blob``)."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from idle import assert_idle
from step_decisions import check_step_decisions

from raymoe.actors.driver import Driver
from raymoe.config import CacheConfig, EngineConfig, GraphConfig, MoeCommConfig, OverlapConfig, SchedulerConfig
from raymoe.errors import InvalidRequestError
from raymoe.runner.graph_buckets import capture_sizes
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.step_output import StepOutput

EOS, VOCAB, MAX_STEPS = 0, 64, 2000
GRAPHS = {"off": GraphConfig(disable_cuda_graph=True), "default": GraphConfig(),
          "sparse": GraphConfig(cuda_graph_bs=(1, 3))}


class CheckingRanks:
    """A fake executor: checks each step's batches when it is launched, answers one token per row (EOS when
    ``(step * 7 + row * 3) % eos_every == 0``), and counts what the steps exercised (``seen``); ``log`` keeps every
    step's batches (for a replay on real ranks)."""

    def __init__(self, config: EngineConfig, dp_size: int, sizes: tuple[int, ...], eos_every: int):
        self.config, self.dp_size, self.sizes, self.eos_every = config, dp_size, sizes, eos_every
        self.steps = 0
        self.seen: Counter = Counter()
        self.log: list[list] = []

    def launch(self, batches):
        cfg = self.config
        check_step_decisions(batches, self.dp_size, cfg.overlap, self.sizes, cfg.moe_comm.a2a_mode,
                             cfg.max_dispatch_tokens_per_rank)
        b = batches[0]
        modes = {x.forward_mode for x in batches}
        idle = ForwardMode.IDLE in modes
        self.seen.update({"steps": 1, "tbo": b.use_tbo, "graph": b.graph_bs is not None, "idle_group": idle,
                          "low_latency": b.dispatch_capacity is not None, "mixed": ForwardMode.MIXED in modes,
                          "tbo_with_idle": b.use_tbo and idle})
        self.steps += 1
        self.log.append(list(batches))
        return [StepOutput([EOS if self.eos_every and (self.steps * 7 + i * 3) % self.eos_every == 0
                            else 1 + (self.steps + i) % (VOCAB - 1) for i in range(x.batch_size)]) for x in batches]

    def collect(self, handle):
        return handle

    def execute(self, batches):
        return self.collect(self.launch(batches))

    def ranks_alive(self) -> bool:
        return True


@st.composite
def workloads(draw, dp: int | None = None) -> dict:
    """An engine configuration, a DP size (``dp``, else drawn) and a list of events ``(step, kind, ...)``."""
    overlap = OverlapConfig(enable_tbo=draw(st.sampled_from([True, True, False])),
                            tbo_decode_schedule=draw(st.sampled_from(["auto", "fine", "coarse"])),
                            tbo_min_tokens_decode=draw(st.sampled_from([1, 2, 4])),
                            tbo_min_tokens_extend=draw(st.sampled_from([1, 4, 16])),
                            tbo_token_distribution_threshold=draw(st.sampled_from([0.0, 0.3, 0.48, 0.5])))
    scheduler = SchedulerConfig(
        max_running_requests=draw(st.integers(1, 8)), chunked_prefill_size=draw(st.sampled_from([None, 3, 8, 32])),
        max_prefill_tokens=draw(st.sampled_from([8, 24, 4096])), schedule_policy=draw(st.sampled_from(["fcfs", "lpm"])),
        enable_mixed_chunk=draw(st.booleans()), disable_overlap_schedule=draw(st.booleans()))
    cache = CacheConfig(max_total_tokens=draw(st.sampled_from([16, 24, 40, 70, 128])), max_context_len=64,
                        enable_radix_cache=draw(st.booleans()))
    moe_comm = MoeCommConfig(a2a_mode=draw(st.sampled_from(["auto", "normal", "low_latency"])),
                             num_max_dispatch_tokens_per_rank=draw(st.sampled_from([None, 1, 3])))
    config = EngineConfig(model="fake", cache=cache, scheduler=scheduler, overlap=overlap, moe_comm=moe_comm,
                          graph=GRAPHS[draw(st.sampled_from(sorted(GRAPHS)))])
    families = [[5 + f] * 12 for f in range(3)]  # shared prompt prefixes, for the radix cache
    events = []
    for i in range(draw(st.integers(1, 16))):
        prefix = families[draw(st.integers(0, 2))][:draw(st.integers(0, 12))]
        suffix = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=10))
        events.append((draw(st.integers(0, 30)), "add", f"r{i}", prefix + suffix, draw(st.integers(1, 40))))
    for _ in range(draw(st.integers(0, 3))):
        events.append((draw(st.integers(0, 40)), "abort", f"r{draw(st.integers(0, 15))}"))
    return {"config": config, "dp": dp or draw(st.integers(1, 4)), "events": sorted(events, key=lambda e: e[0]),
            "eos_every": draw(st.sampled_from([0, 5, 13]))}


def run_workload(w: dict) -> CheckingRanks:
    """Drive ``w`` to completion; every launched step is checked. Returns the executor (its counts)."""
    config, dp = w["config"], w["dp"]
    graph = config.graph
    sizes = () if graph.disable_cuda_graph else tuple(
        capture_sizes(config.scheduler.max_running_requests, graph.cuda_graph_bs, graph.cuda_graph_max_bs))
    ranks = CheckingRanks(config, dp, sizes, w["eos_every"])
    driver = Driver(config, ranks, [EOS], lambda ids: "", dp_size=dp, graph_capture_sizes=sizes, vocab_size=VOCAB)
    events, last = list(w["events"]), max((e[0] for e in w["events"]), default=0)
    for step in range(MAX_STEPS):
        while events and events[0][0] == step:
            _, kind, rid, *rest = events.pop(0)
            if kind == "abort":
                driver.abort_request(rid)
                continue
            try:
                driver.add_request(rid, rest[0], SamplingParams(max_tokens=rest[1], temperature=0.0))
            except InvalidRequestError:
                pass  # too long for the pool or the context: refused on admission, as the front end would be
        if step > last and not driver.has_unfinished():
            break
        driver.step()
    assert not driver.has_unfinished(), "the driver made no progress"
    assert_idle(driver)
    ranks.seen["retraction"] += sum(s.num_retractions for s in driver.schedulers)
    return ranks


@settings(max_examples=1000, deadline=None, derandomize=False, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workloads())
def test_random_workloads_keep_every_step_decision_shared_and_consistent(w):
    for key, count in run_workload(w).seen.items():
        if count:
            event(key)  # --hypothesis-show-statistics: the share of workloads that reached each decision


def test_fixed_workloads_exercise_every_decision_the_check_covers():
    """The random test's check is not vacuous: two workloads reach TBO (beside an IDLE group too), graphs,
    low-latency steps, MIXED steps and retraction."""
    overlap = OverlapConfig(enable_tbo=True, tbo_min_tokens_decode=2, tbo_min_tokens_extend=4)
    config = EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=40, max_context_len=48),
                          scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=8), overlap=overlap,
                          graph=GraphConfig())
    events = [(0, "add", f"a{i}", [3 + i] * 9, 2 if i % 2 else 12) for i in range(4)]  # group 1's end early
    events += [(6, "add", "late", [40] * 7, 3), (9, "add", "short", [41, 42], 1)]
    seen = run_workload({"config": config, "dp": 2, "events": events, "eos_every": 0}).seen
    tight = EngineConfig(model="fake", cache=CacheConfig(max_total_tokens=70, max_context_len=64),
                         scheduler=SchedulerConfig(max_running_requests=8, chunked_prefill_size=8), overlap=overlap)
    events = [(0, "add", f"b{i}", [3 + i % 3] * 4 + [i + 1] * 4, 30 + i) for i in range(6)]
    seen += run_workload({"config": tight, "dp": 2, "events": events, "eos_every": 0}).seen
    kinds = ("tbo", "graph", "idle_group", "low_latency", "mixed", "tbo_with_idle", "retraction")
    assert all(seen[k] > 0 for k in kinds), seen
