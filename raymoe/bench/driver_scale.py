"""``raymoe bench driver-scale``: what the engine's control plane costs per step as the cluster grows, with ranks
that answer instantly (no model runs), so only scheduling, batch building, result processing, output emission and
fan-out are measured.

For each (dp, running) cell it builds the serving engine's driver for a CUDA cluster's defaults (tp=1, ep=dp,
two-batch overlap on, overlap scheduling on, decode graphs for every batch size up to ``running``), admits
``dp * running`` requests, lets them reach decode, then runs ``--steps`` decode steps through the real step loop
(``DriverService``) and reports per step:

* the CPU time of the driver's loop thread (its own clock, so waiting is not counted), milliseconds;
* the bytes each rank receives (the pickled step its fan-out sends it) and the bytes of the output batch the loop
  publishes to the front end.

Each cell is run ``--repeats`` times and the median is printed. The table goes to stdout and
``bench_results/driver_scale.json``.
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


def measure(dp: int, running: int, steps: int) -> dict:
    """One run of one cell (module docstring); returns its per-step figures."""
    max_tokens = 4 * steps + 64  # no request finishes during the run; the pool holds every request's reservation
    config = EngineConfig(
        model="unused", parallel=ParallelConfig(dp_size=dp, ep_size=dp, tp_size=1),
        overlap=OverlapConfig(enable_tbo=True),
        scheduler=SchedulerConfig(max_running_requests=running, max_queued_requests=running * 4,
                                  chunked_prefill_size=4096, max_prefill_tokens=16_384),
        cache=CacheConfig(max_total_tokens=running * (PROMPT_LEN + max_tokens), max_context_len=1024))
    executor = InstantExecutor()
    driver = Driver(config, executor, eos_token_ids=[0], detokenize=None, dp_size=dp,
                    graph_capture_sizes=capture_sizes(running), vocab_size=VOCAB, a2a_mode="auto")
    published: list[int] = []
    samples: list[tuple[float, int]] = []  # (loop thread CPU seconds, bytes sent so far) at each full decode step
    enough = threading.Event()
    step = driver.step

    def timed_step():  # on the loop thread: the CPU between two step entries is one whole loop iteration
        if sum(s.num_running for s in driver.schedulers) == dp * running and not enough.is_set():
            samples.append((time.thread_time(), len(executor.bytes_per_rank)))
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
    cpu = samples[-1][0] - samples[0][0]
    first, last = samples[0][1], samples[-1][1]
    rank_bytes = executor.bytes_per_rank[first:last]
    out_bytes = published[-len(rank_bytes):] if published else [0]
    return {"driver_ms": 1e3 * cpu / (len(samples) - 1), "bytes_per_rank": statistics.median(rank_bytes),
            "output_bytes": statistics.median(out_bytes)}


def add_driver_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", default="1,4,16,32", help="DP group counts")
    p.add_argument("--running", default="16,64,256", help="running requests per group")
    p.add_argument("--steps", type=int, default=50, help="decode steps measured per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell (the median is reported)")
    p.add_argument("--out", default="bench_results/driver_scale.json")


def run_driver_scale(a: argparse.Namespace) -> None:
    dps = [int(x) for x in a.dp.split(",")]
    runnings = [int(x) for x in a.running.split(",")]
    rows = []
    print("driver CPU per decode step (ms) | bytes each rank receives per step | output batch bytes per step")
    print(f"{'dp':>4} {'running':>8} {'driver ms':>10} {'rank bytes':>12} {'output bytes':>13}")
    for dp in dps:
        for running in runnings:
            runs = [measure(dp, running, a.steps) for _ in range(a.repeats)]
            row = {"dp": dp, "running": running, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
            rows.append(row)
            print(f"{dp:>4} {running:>8} {row['driver_ms']:>10.2f} {row['bytes_per_rank']:>12,.0f} "
                  f"{row['output_bytes']:>13,.0f}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
