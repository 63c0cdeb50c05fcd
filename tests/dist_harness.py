"""Run a function on N gloo ranks in spawned processes (for multi-rank tests below the Ray layer).

``run_ranks(fn, parallel, *args)`` starts ``parallel.world_size`` processes; each joins the process groups via
``init_parallel_groups`` and calls ``fn(groups, *args)``; the per-rank return values come back in rank order.
A rank that raises makes ``run_ranks`` raise with its traceback; a hang is cut off by ``timeout_s``.
"""

from __future__ import annotations

import socket
import traceback

import torch.multiprocessing as mp

from raymoe.config import ParallelConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, parallel, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    from raymoe.cluster.topology import init_parallel_groups

    torch.set_num_threads(1)
    try:
        groups = init_parallel_groups(rank, parallel, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
        queue.put((rank, "ok", fn(groups, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, parallel: ParallelConfig, *args, timeout_s: float = 240.0) -> list:
    """Run ``fn(groups, *args)`` on every rank; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, parallel, port, fn, args, queue), daemon=True)
             for r in range(parallel.world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(parallel.world_size)]
