"""NCCL expert parallelism at ep = number of GPUs (``pytest -m gpu tests/gpu``; needs 2+ GPUs): the low-latency
and normal dispatch/combine over NCCL equal the per-token reference on every rank."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")]


def scale_rows(rows, local: torch.Tensor) -> torch.Tensor:
    """Toy experts for a dispatch's answer: local expert ``e`` multiplies its rows by ``local[e]``, in the
    answer's own layout (``ExpertRows``: per-row ids; ``GroupedExpertRows``: segments; masked: per expert)."""
    from raymoe.comm.expert_input import ExpertRows, GroupedExpertRows

    if isinstance(rows, ExpertRows):
        return rows.x * local[rows.local_ids].unsqueeze(-1)
    if isinstance(rows, GroupedExpertRows):
        pos = torch.arange(rows.x.shape[0], device=rows.x.device)
        expert = torch.searchsorted(rows.ends.long(), pos, right=True).clamp_(max=local.numel() - 1)
        return rows.x * local[expert].unsqueeze(-1)
    return rows.x * local.view(-1, 1, 1)


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    from raymoe.cluster.topology import init_parallel_groups
    from raymoe.comm.dispatcher import TorchDispatcher
    from raymoe.config import ParallelConfig
    from raymoe.platform.selector import select_platform
    from raymoe.runner.device import rank_device

    device = rank_device("cuda", rank)
    groups = init_parallel_groups(rank, ParallelConfig(tp_size=1, dp_size=world, ep_size=world),
                                  f"tcp://127.0.0.1:{port}", "nccl", device_id=device)
    num_experts, k, h = 4 * world, 2, 64
    g = torch.Generator().manual_seed(rank)
    n = 3 + 2 * rank
    x = torch.randn(n, h, generator=g).to(device)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]).to(device)
    w = torch.softmax(torch.randn(n, k, generator=g), dim=-1).to(device)
    scale = torch.arange(1, num_experts + 1, dtype=torch.float32, device=device)  # expert e multiplies by e + 1
    a2a = TorchDispatcher(groups, num_experts, select_platform(device))
    results = []
    for capacity in (None, 3 + 2 * (world - 1)):
        handle = a2a.dispatch_a(x, ids, w, capacity)
        rows = a2a.dispatch_b(handle)
        local = scale[groups.ep_rank * a2a.num_local_experts:(groups.ep_rank + 1) * a2a.num_local_experts]
        a2a.combine_a(handle, scale_rows(rows, local))
        results.append(a2a.combine_b(handle))
    ref = (x.unsqueeze(1) * (scale[ids] * w).unsqueeze(-1)).sum(1)
    queue.put((rank, [float((r - ref).abs().max()) for r in results]))
    torch.distributed.destroy_process_group()


def test_nccl_dispatch_combine_at_ep_equal_gpus():
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    errors = dict(queue.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    assert all(max(e) < 1e-4 for e in errors.values()), errors
