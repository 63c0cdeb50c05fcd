"""Shared-memory EP all-to-all (``raymoe.platform.cpu.shm``, the CPU platform's transport): byte-identical to gloo for
equal and variable splits, several calls in flight, both MoE dispatch modes; the gloo fallback for messages over a
slot; clear errors for misuse, a silent peer and a bad ``cpu_comm``."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from raymoe.comm.dispatcher import TorchDispatcher
from raymoe.comm.expert_input import GroupedExpertRows
from raymoe.comm.groups import ParallelGroups
from raymoe.config import MoeCommConfig, ParallelConfig
from raymoe.errors import InvalidRequestError
from raymoe.platform.cpu.kernels import build
from raymoe.platform.cpu.shm import ShmAllToAll
from raymoe.platform.cpu.shm_layout import (
    NATIVE_SPIN_NS,
    OVERSUBSCRIBED_SPIN_NS,
    ShmLayout,
    default_spin_ns,
    shm_supported,
)
from raymoe.platform.cpu.transport import ShmEpTransport
from raymoe.platform.reference.platform import TorchPlatform

pytestmark = pytest.mark.skipif(not shm_supported(), reason="needs x86-64 and a writable /dev/shm")


def _split_matrix(p: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 6, (p, p), generator=g).tolist()  # [src][dst] rows, the same on every rank


def _exchanges(groups: ParallelGroups, native: bool) -> dict:
    """Run the same exchanges through shared memory (the C exchange or the Python protocol) and through gloo;
    report whether they agree."""
    assert isinstance(groups.ep_transport, ShmEpTransport), "cpu_comm=shm must give the EP group shared memory"
    shm, p, me = ShmAllToAll.create(groups.ep_group, native=native), groups.ep_size, groups.ep_rank
    report = {"native": shm.native == native}
    # equal splits, three dtypes, two calls in flight, waited in reverse order
    g = torch.Generator().manual_seed(me)
    inputs = [torch.randn(p * 5, 3, generator=g), torch.randint(0, 1 << 40, (p * 4,), generator=g),
              torch.randn(p * 2, 7, generator=g).to(torch.bfloat16)]
    for i, x in enumerate(inputs):
        ref = torch.empty_like(x)
        dist.all_to_all_single(ref, x, group=groups.ep_group)
        a, b = torch.empty_like(x), torch.empty_like(x)
        wa, wb = shm.all_to_all_single(a, x), shm.all_to_all_single(b, x * 2 if x.is_floating_point() else x)
        wb.wait()
        wa.wait()
        report[f"equal{i}"] = torch.equal(a, ref) and torch.equal(b, ref * 2 if x.is_floating_point() else ref)
    # variable splits (rows of dim 0), including empty chunks
    m = _split_matrix(p, 7)
    send, recv = m[me], [m[s][me] for s in range(p)]
    x = torch.randn(sum(send), 4, generator=g)
    ref = x.new_empty(sum(recv), 4)
    dist.all_to_all_single(ref, x, recv, send, group=groups.ep_group)
    out = x.new_empty(sum(recv), 4)
    shm.all_to_all_single(out, x, recv, send).wait()
    report["varlen"] = torch.equal(out, ref)
    # the transport: counts matrix, and the fallback to gloo for a message over a slot
    t = ShmEpTransport(groups, shm)
    s_l, r_l, max_pair = t.exchange_counts(torch.tensor(send))
    report["counts"] = (s_l, r_l, max_pair) == (send, recv, max(max(r) for r in m))
    big = torch.randn(p * (shm.layout.slot_bytes // 4 + 1), generator=g)
    ref = torch.empty_like(big)
    dist.all_to_all_single(ref, big, group=groups.ep_group)
    got = torch.empty_like(big)
    before = t.dist_calls
    t.all_to_all_equal(got, big).wait()
    report["fallback"] = torch.equal(got, ref) and t.dist_calls == before + 1
    # all-gather (the low-latency dispatch): through shared memory, and through gloo for a message over a slot
    for name, n in (("all_gather", 6), ("all_gather_fallback", shm.layout.slot_bytes // 4 + 1)):
        x = torch.arange(n, dtype=torch.float32) + 1000 * me
        ref = [torch.empty_like(x) for _ in range(p)]
        dist.all_gather(ref, x, group=groups.ep_group)
        got = torch.empty(p, n)
        shm_before, dist_before = t.shm_calls, t.dist_calls
        t.all_gather(got, x).wait()
        path_ok = (t.dist_calls == dist_before + 1) if name.endswith("fallback") else (t.shm_calls == shm_before + 1)
        report[name] = torch.equal(got, torch.stack(ref)) and path_ok
    try:
        shm.all_gather(torch.empty(p + 1), torch.ones(1))
        report["all_gather_size_error"] = False
    except ValueError as e:
        report["all_gather_size_error"] = "is not" in str(e)
    # waits in any order (TBO children interleave): K calls in flight, waited newest first, twice around the ring
    k = shm.layout.num_slots
    for _ in range(2):
        outs = [torch.empty(p) for _ in range(k)]
        works = [shm.all_to_all_single(o, torch.full((p,), float(10 * me + i))) for i, o in enumerate(outs)]
        for w in reversed(works):
            w.wait()
        expect = [torch.tensor([10.0 * s + i for s in range(p)]) for i in range(k)]
        report["out_of_order"] = report.get("out_of_order", True) and all(map(torch.equal, outs, expect))
    # misuse: a call whose slot is still held by a call this rank never waited on
    works = [shm.all_to_all_single(torch.empty(p), torch.ones(p)) for _ in range(k)]
    try:
        shm.all_to_all_single(torch.empty(p), torch.ones(p))
        report["inflight_error"] = False
    except RuntimeError as e:
        report["inflight_error"] = "not waited on" in str(e)
    for w in works:
        w.wait()
    return report


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("ep", [2, 4])
def test_shared_memory_all_to_all_equals_gloo(ep, native):
    from dist_harness import run_ranks

    if native and build.load() is None:
        pytest.skip("the C kernel library cannot be built here")
    for rank, report in enumerate(run_ranks(_exchanges, ParallelConfig(tp_size=1, dp_size=ep, ep_size=ep), native,
                                            cpu_comm="shm")):
        assert all(report.values()), (rank, report)


def _dispatch_both_transports(groups: ParallelGroups) -> dict:
    """Normal and low-latency MoE dispatch/combine with shared memory and with gloo only, same inputs."""
    e, k, h = 8, 2, 16
    g = torch.Generator().manual_seed(groups.ep_rank)
    n = 3 + 2 * groups.ep_rank
    x = torch.randn(n, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), dim=-1)
    results = {}
    for name, grp in (("shm", groups), ("gloo", dataclasses.replace(groups, ep_transport=None))):
        a2a = TorchDispatcher(grp, e, TorchPlatform())
        for mode, capacity in (("normal", None), ("low_latency", 3 + 2 * (groups.ep_size - 1))):
            handle = a2a.dispatch_a(x, ids, w, capacity)
            rows = a2a.dispatch_b(handle)
            assert isinstance(rows, GroupedExpertRows) == (mode == "low_latency")
            y = rows.x * 2.0 + 1.0  # any per-row function: both carriers must return the same combine
            a2a.combine_a(handle, y)
            results[f"{name}/{mode}"] = a2a.combine_b(handle)
        results[f"{name}/calls"] = sum(getattr(d.transport, "shm_calls", 0) for d in (a2a.normal, a2a.low_latency))
    return {"normal": torch.equal(results["shm/normal"], results["gloo/normal"]),
            "low_latency": torch.equal(results["shm/low_latency"], results["gloo/low_latency"]),
            "used_shm": results["shm/calls"] > 0 and results["gloo/calls"] == 0}


def test_moe_dispatch_through_shared_memory_equals_gloo():
    from dist_harness import run_ranks

    for rank, report in enumerate(run_ranks(_dispatch_both_transports,
                                            ParallelConfig(tp_size=1, dp_size=2, ep_size=2), cpu_comm="shm")):
        assert all(report.values()), (rank, report)


def _silent_peer(groups: ParallelGroups, native: bool) -> str:
    shared = groups.ep_transport.shm
    shm = ShmAllToAll(groups.ep_rank, shared.layout, shared._buf, timeout_s=0.5, native=native)
    if groups.ep_rank == 1:
        return "skipped"
    try:
        shm.all_to_all_single(torch.empty(2), torch.ones(2)).wait()
    except TimeoutError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_silent_peer_times_out_with_a_clear_error(native):
    from dist_harness import run_ranks

    if native and build.load() is None:
        pytest.skip("the C kernel library cannot be built here")
    msg = run_ranks(_silent_peer, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), native, cpu_comm="shm")[0]
    assert "rank 1 did not post for call 1 within 0.5 s" in msg


def _aborted_by_peer(groups: ParallelGroups, native: bool) -> str:
    import time

    from raymoe.platform.cpu.shm import ShmAborted

    shared = groups.ep_transport.shm
    shm = ShmAllToAll(groups.ep_rank, shared.layout, shared._buf, timeout_s=30.0, native=native)
    if groups.ep_rank == 1:  # never posts; aborts the mapping while rank 0 waits for it
        time.sleep(0.3)
        shm.abort()
        return "aborted"
    t0 = time.monotonic()
    try:
        shm.all_to_all_single(torch.empty(2), torch.ones(2)).wait()
    except ShmAborted:
        waited = time.monotonic() - t0
        try:  # every later call of the group raises before it posts
            shm.all_to_all_single(torch.empty(2), torch.ones(2))
        except ShmAborted:
            return f"aborted after {waited:.2f} s"
        return "a call after the abort posted"
    return "no error"


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_an_abort_ends_a_peer_wait_at_once(native):
    """``ShmAllToAll.abort`` (an elastic shrink's survivors, stuck waiting for a dead peer) ends the wait of every
    rank of the mapping with ``ShmAborted`` well within its 30 s timeout, and no later call posts."""
    from dist_harness import run_ranks

    if native and build.load() is None:
        pytest.skip("the C kernel library cannot be built here")
    out = run_ranks(_aborted_by_peer, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), native, cpu_comm="shm")
    assert out[1] == "aborted"
    assert out[0].startswith("aborted after"), out
    assert float(out[0].split()[2]) < 5.0, out


def test_config_checks():
    with pytest.raises(InvalidRequestError) as e:
        MoeCommConfig(cpu_comm="nvlink")
    assert e.value.field == "cpu_comm"
    for bad in ((1, 4, 1024), (2, 1, 1024), (2, 4, 8)):
        with pytest.raises(ValueError):
            ShmLayout(*bad)
    cores = len(os.sched_getaffinity(0))
    assert default_spin_ns(cores) == NATIVE_SPIN_NS > default_spin_ns(cores + 1) == OVERSUBSCRIBED_SPIN_NS
    layout = ShmLayout(2, 4, 4096)
    assert layout.control_entries == 2 * 2 * (1 + 4)
    assert layout.total_bytes == layout.control_bytes + 2 * 2 * 4 * 4096
    assert layout.slot_offset(1, 0, 3) == layout.control_bytes + (2 * 4 + 3) * 4096
