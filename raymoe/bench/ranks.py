"""Spawn gloo ranks for benchmarks below the Ray layer (same idea as the tests' ``dist_harness``).

``spawn_ranks(fn, parallel, *args)`` starts ``parallel.world_size`` processes on 127.0.0.1; each sets
``torch.set_num_threads(threads_per_rank)``, joins the process groups (``init_parallel_groups``, with the CPU
platform's EP transport), runs
``fn(groups, *args)`` and sends its return value back; results come back in rank order. ``fn`` must be a
module-level function (it is pickled into spawned processes).
"""

from __future__ import annotations

import socket
import traceback

import torch.multiprocessing as mp

from raymoe.config import ParallelConfig


def _entry(rank, parallel, port, threads, cpu_comm, fn, args, queue, listen_sock=None):
    import os

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from raymoe.cluster.topology import init_parallel_groups
    from raymoe.platform.selector import select_platform

    torch.set_num_threads(threads)
    try:
        groups = init_parallel_groups(rank, parallel, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=300,
                                      cpu_comm=cpu_comm, platform=select_platform("cpu"), listen_sock=listen_sock)
        queue.put((rank, "ok", fn(groups, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn, parallel: ParallelConfig, *args, threads_per_rank: int = 1, timeout_s: float = 3600.0,
                cpu_comm: str = "auto") -> list:
    """Run ``fn(groups, *args)`` on every rank of ``parallel``; returns the per-rank results in rank order.
    ``cpu_comm``: the EP all-to-all carrier (``init_parallel_groups``: auto, shm or gloo).

    Raises:
        RuntimeError: a rank raised (its traceback is in the message).
        queue.Empty: no answer within ``timeout_s`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # The rendezvous port is bound here and held until rank 0's store takes the socket over: no other job (a second
    # test session on the machine) can take it in between and have this job's ranks join its store.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, parallel.world_size))
    port = sock.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(r, parallel, port, threads_per_rank, cpu_comm, fn, args, queue,
                                              sock if r == 0 else None), daemon=True)
             for r in range(parallel.world_size)]
    try:
        for p in procs:
            p.start()
    finally:
        sock.close()  # rank 0 holds its own duplicate
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
