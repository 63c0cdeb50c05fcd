"""``raymoe bench driver-scale``: what the engine's control plane costs per step as the cluster grows, with ranks
that answer instantly (no model runs), so only scheduling, batch building, result processing, output emission and
fan-out are measured.

For each (dp, running) cell it builds the serving engine's driver for a CUDA cluster's defaults (tp=1, ep=dp,
two-batch overlap on, overlap scheduling on, decode graphs for every batch size up to ``running``), admits
``dp * running`` requests, lets them reach decode, then runs ``--steps`` decode steps through the real step loop
(``DriverService``). Two engines (``--group-schedulers``):

* ``driver``: every group's scheduler in the driver's process (``raymoe.actors.driver.Driver``); the driver's CPU
  is everything and is the critical path;
* ``actors``: one group server per DP group (``raymoe.actors.hosted_driver.HostedDriver``). On this benchmark the
  group servers run in the loop's process behind pickling loopback links (``raymoe.actors.loopback_groups``), one
  after another, and each one's CPU is clocked apart (``LoopbackLink.cpu_seconds``): a small machine cannot run 64
  group processes in parallel, so the figures of separate processes are computed from per-process CPU times. The
  socket calls the loopback skips are measured on a real socket pair with the measured message sizes and added
  (the driver sends and receives one message per group, each group one).

The benchmark's process takes the GC policy of the served driver and group processes
(``raymoe.actors.process_tuning.configure_driver_gc``). Reported per step (median of ``--repeats`` runs): the
driver's CPU; each group server's CPU (max and median over groups; ``actors`` only) and that per running request;
the messaging CPU included in those; the critical path (driver + slowest group); the bytes each rank receives (its
group's pickled batch) and the output bytes (the driver's published batch; with ``actors``, the largest group's).
The table goes to stdout and ``bench_results/driver_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import threading
import time
from pathlib import Path

from raymoe.actors.driver import Driver
from raymoe.actors.driver_service import AddRequest, DriverService
from raymoe.config import CacheConfig, EngineConfig, OverlapConfig, ParallelConfig, SchedulerConfig
from raymoe.runner.graph_buckets import capture_sizes
from raymoe.scheduler.sampling_params import SamplingParams
from raymoe.step.step_output import StepOutput

PROMPT_LEN = 16
VOCAB = 32_000


class InstantExecutor:
    """Ranks that answer every step at once with token 1 per row; records the bytes each rank would receive (its
    group's batch as the step channel pickles it, ``raymoe.actors.step_channel``)."""

    def __init__(self):
        self.bytes_per_rank: list[int] = []

    def launch(self, batches):
        payloads = [pickle.dumps((0, b), protocol=pickle.HIGHEST_PROTOCOL) for b in batches]
        self.bytes_per_rank.append(max(map(len, payloads)))
        return [StepOutput([1] * b.batch_size) for b in batches]

    def collect(self, handle):
        return handle

    def execute(self, batches):
        return self.collect(self.launch(batches))

    def ranks_alive(self) -> bool:
        return True


def _config(dp: int, running: int, steps: int) -> tuple[EngineConfig, int]:
    max_tokens = 4 * steps + 64  # no request finishes during the run; the pool holds every request's reservation
    return EngineConfig(
        model="unused", parallel=ParallelConfig(dp_size=dp, ep_size=dp, tp_size=1),
        overlap=OverlapConfig(enable_tbo=True),
        scheduler=SchedulerConfig(max_running_requests=running, max_queued_requests=running * 4,
                                  chunked_prefill_size=4096, max_prefill_tokens=16_384),
        cache=CacheConfig(max_total_tokens=running * (PROMPT_LEN + max_tokens), max_context_len=1024)), max_tokens


def socket_seconds(payload: int, repeats: int = 2000) -> float:
    """CPU seconds to send and to receive one message of ``payload`` bytes over a Unix socket pair
    (``multiprocessing.connection``, as the group links), per side (half of both), measured in one thread."""
    from multiprocessing import Pipe

    a, b = Pipe()
    data = b"x" * payload
    t0 = time.thread_time()
    for _ in range(repeats):
        a.send_bytes(data)
        b.recv_bytes()
    return (time.thread_time() - t0) / repeats / 2


def _run(driver, executors, dp: int, running: int, steps: int, max_tokens: int, published: list[int],
         running_now) -> list[tuple[float, int]]:
    """Drive ``driver`` through the real loop; returns (loop CPU seconds, steps sent) at each full decode step."""
    samples: list[tuple[float, int]] = []
    enough = threading.Event()
    step = driver.step

    def timed_step():  # on the loop thread: the CPU between two step entries is one whole loop iteration
        if running_now() == dp * running and not enough.is_set():
            samples.append((time.thread_time(), len(executors[0].bytes_per_rank), time.perf_counter()))
            if len(samples) > steps:
                enough.set()
        return step()

    driver.step = timed_step
    service = DriverService(driver, lambda batch: published.append(len(pickle.dumps(batch))))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        service.submit([AddRequest(f"r{i}", [2 + (i + j) % 1000 for j in range(PROMPT_LEN)], params)
                        for i in range(dp * running)])
        if not enough.wait(600):
            raise TimeoutError(f"dp={dp} running={running}: requests did not all reach decode")
    finally:
        service.shutdown()
    return samples


def measure(dp: int, running: int, steps: int) -> dict:
    """One run of one cell with the groups in the driver's process (module docstring)."""
    config, max_tokens = _config(dp, running, steps)
    executor = InstantExecutor()
    driver = Driver(config, executor, eos_token_ids=[0], detokenize=None, dp_size=dp,
                    graph_capture_sizes=capture_sizes(running), vocab_size=VOCAB, a2a_mode="auto")
    published: list[int] = []
    samples = _run(driver, [executor], dp, running, steps, max_tokens, published,
                   lambda: sum(s.num_running for s in driver.schedulers))
    n = len(samples) - 1
    driver_ms = 1e3 * (samples[-1][0] - samples[0][0]) / n
    rank_bytes = executor.bytes_per_rank[samples[0][1]:samples[-1][1]]
    return {"driver_ms": driver_ms, "group_ms_max": 0.0, "group_ms_median": 0.0, "messaging_ms": 0.0,
            "critical_ms": driver_ms, "group_us_per_request": 1e3 * driver_ms / (dp * running),
            "bytes_per_rank": statistics.median(rank_bytes), "output_bytes": statistics.median(published[-n:])}


def measure_hosted(dp: int, running: int, steps: int) -> dict:
    """One run of one cell with one group server per DP group, clocked apart (module docstring)."""
    from raymoe.actors.hosted_driver import HostedDriver
    from raymoe.actors.loopback_groups import LoopbackGroups

    config, max_tokens = _config(dp, running, steps)
    executors = [InstantExecutor() for _ in range(dp)]
    group_out: list[list[int]] = [[] for _ in range(dp)]
    groups = LoopbackGroups(config, [0], None, VOCAB, lambda d: executors[d], lambda batch: None, dp)
    for d, server in enumerate(groups.servers):  # each group's rows as its own connection to the front end sends them
        server.publish = lambda batch, d=d: group_out[d].append(len(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)))
    driver = HostedDriver(config, groups, dp, graph_capture_sizes=capture_sizes(running), vocab_size=VOCAB,
                          a2a_mode="auto")
    published: list[int] = []
    cpu0: list[float] = []
    step = driver.step

    def step_with_group_clock():
        if not cpu0 and sum(s.num_running for s in driver.group_stats()) == dp * running:
            cpu0.extend(link.cpu_seconds for link in groups.links)
            bytes0.extend((link.bytes_in, link.bytes_out) for link in groups.links)
        return step()

    bytes0: list[tuple[int, int]] = []
    driver.step = step_with_group_clock
    samples = _run(driver, executors, dp, running, steps, max_tokens, published,
                   lambda: sum(s.num_running for s in driver.group_stats()))
    n = len(samples) - 1
    exchanges = max(1, len(executors[0].bytes_per_rank) - samples[0][1])  # steps since the clocks started
    group_s = [(link.cpu_seconds - c) / exchanges for link, c in zip(groups.links, cpu0, strict=True)]
    loop_s = (samples[-1][0] - samples[0][0]) / n
    cmd = max((link.bytes_in - b[0]) / exchanges for link, b in zip(groups.links, bytes0, strict=True))
    reply = max((link.bytes_out - b[1]) / exchanges for link, b in zip(groups.links, bytes0, strict=True))
    per_message = socket_seconds(int(cmd)) + socket_seconds(int(reply))
    driver_s = loop_s - sum(group_s) + dp * per_message
    group_max = max(group_s) + per_message
    rank_bytes = [b for e in executors for b in e.bytes_per_rank[samples[0][1]:samples[-1][1]]]
    out = [b for g in group_out for b in g[-n:]] or [0]
    return {"driver_ms": 1e3 * driver_s, "group_ms_max": 1e3 * group_max,
            "group_ms_median": 1e3 * (statistics.median(group_s) + per_message),
            "messaging_ms": 1e3 * dp * per_message, "critical_ms": 1e3 * (driver_s + group_max),
            "group_us_per_request": 1e6 * group_max / running, "bytes_per_rank": max(rank_bytes),
            "output_bytes": max(out)}


def add_driver_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", default="1,4,16,32", help="DP group counts")
    p.add_argument("--running", default="16,64,256", help="running requests per group")
    p.add_argument("--steps", type=int, default=50, help="decode steps measured per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell (the median is reported)")
    p.add_argument("--group-schedulers", default="driver,actors",
                   help="engines to measure: driver (groups in the driver's process), actors (one group server "
                        "per DP group, clocked apart)")
    p.add_argument("--out", default="bench_results/driver_scale.json")


COLUMNS = (("driver_ms", "driver ms", ".2f"), ("group_ms_max", "group max ms", ".2f"),
           ("group_ms_median", "group med ms", ".2f"), ("group_us_per_request", "us/req", ".2f"),
           ("messaging_ms", "messages ms", ".3f"), ("critical_ms", "critical ms", ".2f"),
           ("bytes_per_rank", "rank bytes", ",.0f"), ("output_bytes", "output bytes", ",.0f"))


def run_driver_scale(a: argparse.Namespace) -> None:
    from raymoe.actors.process_tuning import configure_driver_gc

    configure_driver_gc()  # the driver and group processes' GC policy, as in a served engine
    dps = [int(x) for x in a.dp.split(",")]
    runnings = [int(x) for x in a.running.split(",")]
    engines = [e.strip() for e in a.group_schedulers.split(",")]
    bad = set(engines) - {"driver", "actors"}
    if bad:
        raise SystemExit(f"--group-schedulers: unknown engine(s) {sorted(bad)} (driver, actors)")
    rows = []
    print("per decode step, ranks answering at once. driver: groups in the driver's process. actors: one group "
          "server per DP group; their CPU is clocked apart in one process (this machine cannot run the groups in "
          "parallel), the socket calls measured on a socket pair and added, critical = driver + slowest group.")
    print(f"{'engine':>7} {'dp':>4} {'running':>8} " + " ".join(f"{h:>13}" for _, h, _ in COLUMNS))
    for engine in engines:
        fn = measure if engine == "driver" else measure_hosted
        for dp in dps:
            for running in runnings:
                runs = [fn(dp, running, a.steps) for _ in range(a.repeats)]
                row = {"engine": engine, "dp": dp, "running": running,
                       **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                rows.append(row)
                print(f"{engine:>7} {dp:>4} {running:>8} " + " ".join(f"{row[k]:>13{f}}" for k, _, f in COLUMNS),
                      flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
