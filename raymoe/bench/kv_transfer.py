"""``raymoe bench kv-transfer``: KV rows moved between two processes' pools, per backend, against a memcpy of the
same bytes.

Two processes (``spawn``) each hold a ``TokenToKVPool`` of ``--pool-tokens`` slots shaped like the model's
(``--layers`` x key/value x ``--kv-heads`` x ``--head-dim``, float32), and an agent of each backend that is
available (``raymoe.kvcache.kv_transfer``: NIXL over UCX on loopback, the gloo fallback). For each request size
(``--tokens``), twice: with the slots in one run on both sides (a fresh pool's pages) and scattered at random (a
long-running pool's), the sender writes the rows into the receiver's slots, ``--iters`` times; a transfer counts
from the sender's start until the receiver holds the rows (the receiver tells it through a pipe, tens of
microseconds). In one process, the same rows copied pool to pool (``index_select`` + ``index_copy_``, what the
gloo path also does on each side) and the same bytes as one contiguous ``copy_`` give the memory system's figure.
Prints GB/s (1e9 bytes per second) and writes JSON. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path


def add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    """The options of ``raymoe bench kv-transfer``."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--pool-tokens", type=int, default=32768, help="KV slots of each side's pool")
    p.add_argument("--tokens", default="512,4096,16384", help="request sizes (tokens of KV moved per transfer)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backends", default="nixl,gloo", help="which agents to measure (missing ones are skipped)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/kv_transfer.json")


def _plans(a: argparse.Namespace) -> list[tuple[str, int, list[int], list[int]]]:
    """(label, tokens, source slots, destination slots) per request size and slot order."""
    import random

    rng = random.Random(a.seed)
    out = []
    for n in (int(t) for t in a.tokens.split(",")):
        out.append(("contiguous", n, list(range(1, n + 1)), list(range(a.pool_tokens - n + 1, a.pool_tokens + 1))))
        out.append(("scattered", n, rng.sample(range(1, a.pool_tokens + 1), n),
                    rng.sample(range(1, a.pool_tokens + 1), n)))
    return out


def _pool(a: argparse.Namespace):
    import torch

    from raymoe.kvcache.pools import TokenToKVPool

    pool = TokenToKVPool(a.pool_tokens, a.layers, a.kv_heads, a.head_dim, torch.float32)
    for b in [*pool.k_buffer, *pool.v_buffer]:
        b.normal_()
    return pool


def _side(role: str, backend: str, a: argparse.Namespace, conn, results) -> None:
    """One process: its pool and agent; the two sides talk over ``conn``, the sender reports to ``results``."""
    from raymoe.kvcache.kv_layout import KVLayout
    from raymoe.kvcache.kv_transfer import make_kv_transfer

    layout = KVLayout.of_pool(_pool(a))
    agent = make_kv_transfer(f"bench-{role}", layout, backend)
    if role == "send":  # one side at a time: metadata can exceed a pipe's buffer
        conn.send(agent.metadata())
        peer = agent.add_peer(conn.recv())
    else:
        peer = agent.add_peer(conn.recv())
        conn.send(agent.metadata())
    times: list[list[float]] = []
    for i, (_, _, src, dst) in enumerate(_plans(a)):
        times.append([])
        for it in range(a.iters + 1):  # the first is a warm-up (connections are set up on first use)
            tag = f"{i}-{it}"
            if role == "send":
                conn.recv()  # the receiver is waiting
                t0 = time.perf_counter()
                agent.send(peer, src, dst, tag, timeout_s=120)
                conn.recv()  # the rows have landed
                if it:
                    times[-1].append(time.perf_counter() - t0)
            else:
                conn.send("ready")
                agent.receive(peer, dst, tag, timeout_s=120)
                conn.send("landed")
    if role == "send":
        results.put(times)
        conn.send("bye")
    else:
        conn.recv()
    agent.close()


def run_pair(target, args: tuple, timeout_s: float):
    """Run ``target(role, *args, conn, results)`` in two spawned processes, roles ``"send"`` and ``"recv"``, joined
    by one pipe (``conn``); returns the first item either puts on ``results``, once both exited.

    Raises:
        AssertionError: a process failed or did not exit. queue.Empty: nothing reported within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    one, two = ctx.Pipe()
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(role, *args, end, results), daemon=True)
             for role, end in (("send", one), ("recv", two))]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=timeout_s)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"a transfer process failed or hung (exit code {p.exitcode})"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return out


def _measure(backend: str, a: argparse.Namespace) -> list[list[float]]:
    """Seconds per transfer, per plan, for one backend (two processes)."""
    return run_pair(_side, (backend, a), 900)


def _memcpy(a: argparse.Namespace) -> list[tuple[float, float]]:
    """Per plan: seconds of the pool-to-pool row copy and of one contiguous copy of the same bytes."""
    import torch

    from raymoe.kvcache.kv_layout import KVLayout

    src, dst = KVLayout.of_pool(_pool(a)), KVLayout.of_pool(_pool(a))
    out = []
    for _, _, s, d in _plans(a):
        rows, flat = [], []
        si, di = torch.tensor(s), torch.tensor(d)
        nbytes = len(s) * sum(src.row_bytes)
        a_buf, b_buf = torch.empty(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
        for it in range(a.iters + 1):
            t0 = time.perf_counter()
            for x, y in zip(src.buffers, dst.buffers, strict=True):
                y.index_copy_(0, di, x.index_select(0, si))
            t1 = time.perf_counter()
            a_buf.copy_(b_buf)
            t2 = time.perf_counter()
            if it:
                rows.append(t1 - t0)
                flat.append(t2 - t1)
        out.append((statistics.median(rows), statistics.median(flat)))
    return out


def run_kv_transfer_bench(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench kv-transfer``: measure, print the table, write the JSON."""
    from raymoe.kvcache.kv_layout import KVLayout
    from raymoe.kvcache.kv_transfer import nixl_available

    row = sum(KVLayout.of_pool(_pool(argparse.Namespace(**{**vars(a), "pool_tokens": 1}))).row_bytes)
    plans = _plans(a)
    backends = [b for b in a.backends.split(",") if b != "nixl" or nixl_available()]
    measured = {b: _measure(b, a) for b in backends}
    copies = _memcpy(a)
    rows = []
    head = f"{'tokens':>7} {'slots':<11} {'MiB':>7} " + "".join(f"{b + ' GB/s':>12}" for b in backends) + \
        f"{'row copy GB/s':>15}{'memcpy GB/s':>13}"
    print(head)
    print("-" * len(head))
    for (label, n, _, _), i, (row_s, flat_s) in zip(plans, range(len(plans)), copies, strict=True):
        nbytes = n * row
        rec = {"tokens": n, "slots": label, "bytes": nbytes, "row_copy_gbps": nbytes / row_s / 1e9,
               "memcpy_gbps": nbytes / flat_s / 1e9}
        for b in backends:
            rec[f"{b}_gbps"] = nbytes / statistics.median(measured[b][i]) / 1e9
        rows.append(rec)
        print(f"{n:>7} {label:<11} {nbytes / 2**20:>7.1f} " + "".join(f"{rec[b + '_gbps']:>12.2f}" for b in backends)
              + f"{rec['row_copy_gbps']:>15.2f}{rec['memcpy_gbps']:>13.2f}")
    report = {"args": {k: v for k, v in vars(a).items() if k != "func"}, "bytes_per_token": row, "rows": rows,
              "backends": backends}
    out = Path(a.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report
