"""One MoE layer's dispatch + experts + combine on CPU ranks: normal vs low-latency mode, gloo vs shared memory.

    python benchmarks/moe_a2a_modes.py [--ep 2] [--tokens 8,32] [--experts 8] [--hidden 128] [--iters 200]
        [--round-trip-bytes 1024,65536,1048576]

Each rank routes its own random tokens (top-2, distinct experts) through ``TorchDispatcher`` in both modes and over
both carriers (gloo, and the shared-memory mapping of ``raymoe.platform.cpu.shm`` where this machine supports it), all
four taking turns in one process; the median over ``iters`` calls (ranks start each call together) is printed in
ms. The low-latency capacity is the token count, as the driver plans an eager decode step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from raymoe.bench.ranks import spawn_ranks
from raymoe.comm.dispatcher import TorchDispatcher
from raymoe.config import ParallelConfig
from raymoe.layers.moe import LocalExperts
from raymoe.platform.selector import select_platform


def _layer_ms(groups, n: int, experts: int, hidden: int, iters: int) -> dict[str, float]:
    torch.manual_seed(groups.ep_rank)
    x = torch.randn(n, hidden)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(n)])
    w = torch.rand(n, 2)
    ops = select_platform("cpu")
    macs = 3 * hidden * (hidden // 2)
    carriers = {"gloo": TorchDispatcher(dataclasses.replace(groups, ep_transport=None), experts, ops, macs)}
    if groups.ep_transport is not None:
        carriers["shm"] = TorchDispatcher(groups, experts, ops, macs)
    local = LocalExperts(experts, hidden, hidden // 2, groups, torch.float32, ops)
    local.w13.data.normal_(0, 0.05)
    local.w2.data.normal_(0, 0.05)
    times: dict[str, list[float]] = {}
    for _ in range(iters):
        for carrier, a2a in carriers.items():
            for mode, capacity in (("normal", None), ("low_latency", n)):
                dist.barrier(group=groups.ep_group)
                t0 = time.perf_counter()
                handle = a2a.dispatch_a(x, ids, w, capacity)
                a2a.combine_a(handle, local.forward_input(a2a.dispatch_b(handle)))
                a2a.combine_b(handle)
                times.setdefault(f"{carrier} {mode}", []).append(time.perf_counter() - t0)
    return {key: 1e3 * statistics.median(ts) for key, ts in times.items()}


def _round_trip_us(groups, nbytes: int, iters: int) -> dict[str, float]:
    """Median microseconds of one blocking equal-split all-to-all of ``nbytes`` per rank, gloo vs shared memory."""
    x = torch.zeros(nbytes // 4)
    y = torch.empty_like(x)
    calls = {"gloo": lambda: dist.all_to_all_single(y, x, group=groups.ep_group)}
    if groups.ep_transport is not None:
        calls["shm"] = lambda: groups.ep_transport.shm.all_to_all_single(y, x).wait()
    out = {}
    for name, call in calls.items():
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        out[name] = 1e6 * statistics.median(ts)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--tokens", default="8,32", help="tokens per rank")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--round-trip-bytes", default="1024,65536,1048576",
                   help="also time one bare all-to-all of these sizes per rank (empty: skip)")
    a = p.parse_args()
    parallel = ParallelConfig(tp_size=1, dp_size=a.ep, ep_size=a.ep)
    for nbytes in (int(b) for b in a.round_trip_bytes.split(",") if b.strip()):
        r = spawn_ranks(_round_trip_us, parallel, nbytes, 2 * a.iters)[0]
        print(f"bare all-to-all, {nbytes} bytes per rank: " + ", ".join(f"{k} {v:.0f} us" for k, v in r.items()))
    print(f"ep={a.ep}, {a.experts} experts top-2, hidden {a.hidden}; ms per MoE layer (median of {a.iters})")
    for i, n in enumerate(int(t) for t in a.tokens.split(",")):
        r = spawn_ranks(_layer_ms, parallel, n, a.experts, a.hidden, a.iters)[0]
        if i == 0:
            print(f"{'tokens':>7} " + " ".join(f"{key:>17}" for key in r))
        print(f"{n:>7} " + " ".join(f"{v:>17.3f}" for v in r.values()), flush=True)


if __name__ == "__main__":
    main()
