"""What a background point-to-point transfer costs a CPU step on gloo (the expert moves of a live rebalance).

Two gloo ranks each run a step of 12 [256, 256] matmuls (one thread) and then a step-ending collective (a barrier
on the world group), 60 steps per mode (medians of the last 50, ms):

* ``plain``: the step alone; ``p2p``: an isend/irecv pair of ``--bytes`` on a group of its own, posted before the
  step and waited after it (raymoe's expert moves); ``sync``: the same pair waited before the step;
  ``p2p_nobarrier`` / ``plain_nobarrier``: the step without its collective.

Run: ``python benchmarks/eplb_transfer_cost.py [--bytes N]``. Prints one line per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _rank(groups, nbytes: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(ranks=[0, 1])
    other = 1 - groups.ep_rank
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    send, recv = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    out = {}
    for mode in ("plain", "p2p", "sync", "p2p_nobarrier", "plain_nobarrier"):
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            works = []
            if mode in ("p2p", "sync", "p2p_nobarrier"):
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, other, group),
                                                dist.P2POp(dist.irecv, recv, other, group)])
            if mode == "sync":
                for w in works:
                    w.wait()
                works = []
            for _ in range(12):
                a @ b
            if not mode.endswith("nobarrier"):
                dist.barrier()
            for w in works:
                w.wait()
            times.append(time.perf_counter() - t0)
        out[mode] = round(statistics.median(times[10:]) * 1000, 2)
    return out


def main() -> None:
    from dist_harness import run_ranks

    from raymoe.config import ParallelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=384_000)
    a = p.parse_args()
    for rank, res in enumerate(run_ranks(_rank, ParallelConfig(dp_size=2, ep_size=2), a.bytes, cpu_comm="gloo")):
        print(f"rank {rank} ({a.bytes} bytes): " + ", ".join(f"{k} {v} ms" for k, v in res.items()))


if __name__ == "__main__":
    main()
