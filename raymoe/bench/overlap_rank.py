"""Rank side of ``raymoe bench overlap``: decode step times with and without two-batch overlap.

Each rank is one DP group (``tp = 1``, ``dp = ep``) decoding ``bs`` requests whose ``context_len`` earlier tokens
are already in the KV cache (table rows filled directly, KV random: contents do not change the timing); every
timed step decodes the same token again (``ModelRunner.forward_batch_generation``: slot table, forward, greedy
sampling). Each MoE block's all-to-all is wrapped in :class:`BenchAllToAll`, which runs in one of three modes:

* ``real``: the gloo all-to-all with the injected one-way latency (``raymoe.comm.latency``);
* ``record``: ``real``, and it also records the local expert ids of the rows each dispatch delivered;
* ``loopback``: no communication. Dispatch ``i`` of a step hands the experts exactly the rows (count and local
  expert of every row) that dispatch ``i`` of the recorded real step delivered to this rank, built from local
  rows; combine returns rows of the right shape. Every rank thus does the expert work of the real step.

Measured per point (medians over ``iters`` steps after ``warmup``, the variants taking turns step by step; a
step's time is the slowest rank's):

* ``compute_ms``: serial step (TBO off) in loopback — the step's compute without any communication;
* ``comm_ms``: only the MoE transfers of a serial step, all ranks together: per MoE layer, dispatch then combine of
  ``bs`` random hidden rows with random top-k experts on the real backend with the injected latency;
* ``serial_ms`` / ``tbo_ms`` / ``sbo_ms``: real steps with TBO off / on / with single-batch overlap;
* ``tbo_compute_ms``: TBO step in loopback (the compute cost of splitting the batch);
* ``serial_latency_exposed`` / ``tbo_latency_exposed``: fraction of the injected latency the step actually waited
  for (slept in ``_b``), rank 0.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from raymoe.comm.all_to_all import DispatchHandle
from raymoe.comm.expert_input import ExpertRows, GroupedExpertRows, MaskedExpertRows, RoutedTokenRows
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.latency import LatencyInjectedAllToAll, wrap_moe_all_to_all
from raymoe.config import GraphConfig, OverlapConfig
from raymoe.runner.model_runner import ModelRunner
from raymoe.runner.runner_config import RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch


def _cyclic_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows taken cyclically from ``x`` [R, H] (zeros when ``x`` is empty)."""
    if x.shape[0] == 0:
        return x.new_zeros((n, x.shape[1]))
    return x[torch.arange(n, device=x.device) % x.shape[0]]


@dataclass
class _LoopbackMasked:
    """Loopback stand-in of a low-latency dispatch: this rank's tokens and the recorded received layout
    (:class:`GroupedExpertRows` or, for small CPU steps, :class:`RoutedTokenRows` from the torch dispatcher;
    :class:`MaskedExpertRows` from DeepEP's)."""

    hidden: torch.Tensor
    recorded: GroupedExpertRows | MaskedExpertRows | RoutedTokenRows
    out: torch.Tensor | None = None


class BenchAllToAll:
    """Benchmark stand-in for one MoE block's dispatcher (modes in the module docstring).

    Args:
        real: the block's real dispatcher (``TorchDispatcher`` over the EP group).
    """

    def __init__(self, real):
        self.real = LatencyInjectedAllToAll(real, 0.0)
        self.mode = "real"
        self.tapes: dict[str, list] = {}
        self.tape: list = []
        self.cursor = 0

    def start_step(self, mode: str, tape: str) -> None:
        """Set the mode for the next step; ``record`` starts tape ``tape`` afresh, ``loopback`` replays it."""
        self.mode = mode
        if mode == "record":
            self.tapes[tape] = []
        self.tape = self.tapes.get(tape, [])
        self.cursor = 0

    def dispatch_a(self, hidden, topk_ids, topk_weights, capacity=None):
        if self.mode != "loopback":
            return self.real.dispatch_a(hidden, topk_ids, topk_weights, capacity)
        recorded = self.tape[self.cursor]
        self.cursor += 1
        if isinstance(recorded, GroupedExpertRows | MaskedExpertRows | RoutedTokenRows):
            return _LoopbackMasked(hidden, recorded)
        n, k = topk_ids.shape
        rows = _cyclic_rows(hidden, recorded.numel())
        return DispatchHandle(n, k, topk_weights, torch.empty(0), [n * k], [recorded.numel()], rows, recorded, [])

    def dispatch_b(self, handle):
        if isinstance(handle, _LoopbackMasked):
            rec = handle.recorded
            x = _cyclic_rows(handle.hidden, rec.x.numel() // rec.x.shape[-1])
            if isinstance(rec, GroupedExpertRows):
                return GroupedExpertRows(x, rec.ends, rec.expert_capacity)
            if isinstance(rec, RoutedTokenRows):
                return RoutedTokenRows(x.view_as(rec.x), rec.topk_ids, rec.topk_weights, rec.first_expert)
            return MaskedExpertRows(x.view_as(rec.x), rec.counts, rec.max_rows)
        if self.mode == "loopback":
            return ExpertRows(handle.recv_hidden, handle.recv_expert_ids)
        rows = self.real.dispatch_b(handle)
        if self.mode == "record":
            if isinstance(rows, GroupedExpertRows):
                self.tape.append(GroupedExpertRows(torch.empty_like(rows.x), rows.ends.clone(), rows.expert_capacity))
            elif isinstance(rows, MaskedExpertRows):
                self.tape.append(MaskedExpertRows(torch.empty_like(rows.x), rows.counts.clone(), rows.max_rows))
            elif isinstance(rows, RoutedTokenRows):  # the routing is the work: keep it, not the rows
                self.tape.append(RoutedTokenRows(torch.empty_like(rows.x), rows.topk_ids.clone(),
                                                 rows.topk_weights.clone(), rows.first_expert))
            else:
                self.tape.append(rows.local_ids.clone())
        return rows

    def combine_a(self, handle, expert_out, part: int = 0, num_parts: int = 1):
        if isinstance(handle, _LoopbackMasked):
            handle.out = expert_out.reshape(-1, expert_out.shape[-1])
        elif self.mode == "loopback":
            handle.combine_parts.append((part, num_parts, expert_out))
        else:
            self.real.combine_a(handle, expert_out, part=part, num_parts=num_parts)

    def combine_b(self, handle):
        if isinstance(handle, _LoopbackMasked):
            return _cyclic_rows(handle.out, handle.hidden.shape[0])
        if self.mode != "loopback":
            return self.real.combine_b(handle)
        out = torch.cat([p[2] for p in sorted(handle.combine_parts, key=lambda p: p[0])])
        pairs = _cyclic_rows(out, handle.num_tokens * handle.top_k).view(handle.num_tokens, handle.top_k, -1)
        return (pairs * handle.topk_weights.unsqueeze(-1)).sum(dim=1)


def decode_batch(runner: ModelRunner, bs: int, context_len: int, seed: int) -> ModelWorkerBatch:
    """Fill table rows ``0..bs-1`` with ``context_len`` cached slots each; return the decode step after them."""
    width = context_len + 1
    table = runner.req_to_token_pool.req_to_token
    for r in range(bs):
        table[r, :context_len] = torch.arange(1 + r * width, 1 + r * width + context_len)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, runner.model_config.vocab_size, (bs,), generator=g).tolist()
    return ModelWorkerBatch(
        ForwardMode.DECODE, ids, list(range(bs)), [width] * bs, [context_len] * bs, [1] * bs,
        [1 + r * width + context_len for r in range(bs)], [], SamplingInputs.greedy(bs))


def _timed_step(groups: ParallelGroups, step) -> float:
    """Seconds the slowest rank spends in ``step()`` (all ranks start it together)."""
    dist.barrier(group=groups.ep_group)
    t0 = time.perf_counter()
    step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=groups.ep_group)
    return dt.item()


def median_step_ms(groups: ParallelGroups, variants: dict, warmup: int, iters: int) -> dict[str, float]:
    """Median step time (ms) of each ``name -> step`` variant, and its minimum as ``<name minus _ms>_min_ms``;
    the variants take turns step by step, so a slow phase of the machine (other processes) affects all alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + iters):
        for name, step in variants.items():
            dt = _timed_step(groups, step)
            if i >= warmup:
                times[name].append(dt)
    out = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    out.update({name.removesuffix("_ms") + "_min_ms": 1e3 * min(ts) for name, ts in times.items()})
    return out


def measure_rank(groups: ParallelGroups, model_path: str, batch_sizes: list[int], latencies_ms: list[float],
                 context_len: int, warmup: int, iters: int, seed: int, a2a_mode: str = "normal") -> list[dict] | None:
    """Run every (batch size, latency) point on this rank; rank 0 returns the points, other ranks ``None``.
    ``a2a_mode``: ``"normal"`` or ``"low_latency"`` (capacity = the batch size, as the driver plans decode)."""
    torch.manual_seed(seed + groups.world_rank)
    max_bs = max(batch_sizes)
    cfg = RunnerConfig(model_path, "float32", num_kv_slots=max_bs * (context_len + 1), max_req_rows=max_bs,
                       max_context_len=context_len + 2, graph=GraphConfig(disable_cuda_graph=True),
                       overlap=OverlapConfig(enable_tbo=True))
    runner = ModelRunner(cfg, groups)
    for k, v in zip(runner.token_to_kv_pool.k_buffer, runner.token_to_kv_pool.v_buffer, strict=True):
        k.normal_(0, 0.5)
        v.normal_(0, 0.5)
    switches: list[BenchAllToAll] = []

    def install(a2a):
        switches.append(BenchAllToAll(a2a))
        return switches[-1]

    wrap_moe_all_to_all(runner.model, install)
    points = []
    for bs in batch_sizes:
        points += _measure_batch_size(groups, runner, switches, bs, latencies_ms, context_len, warmup, iters, seed,
                                      a2a_mode)
    return points if groups.world_rank == 0 else None


def _measure_batch_size(groups: ParallelGroups, runner: ModelRunner, switches: list[BenchAllToAll], bs: int,
                        latencies_ms: list[float], context_len: int, warmup: int, iters: int, seed: int,
                        a2a_mode: str) -> list[dict]:
    mc = runner.model_config
    capacity = bs if a2a_mode == "low_latency" else None
    batches = {"serial": replace(decode_batch(runner, bs, context_len, seed + groups.world_rank),
                                 dispatch_capacity=capacity)}
    batches["tbo"] = replace(batches["serial"], use_tbo=True)
    hidden = torch.randn(bs, mc.hidden_size)
    topk = torch.stack([torch.randperm(mc.num_experts)[:mc.num_experts_per_tok] for _ in range(bs)])
    weights = torch.full(topk.shape, 1.0 / topk.shape[1])

    def step(name: str, mode: str = "real", sbo: bool = False):
        for s in switches:
            s.start_step(mode, name)
        runner.model.enable_sbo = sbo  # benchmark-only switch: every rank flips it at the same point
        out = runner.forward_batch_generation(batches[name])
        runner.model.enable_sbo = False
        return out

    def comm_step() -> None:
        for a2a in switches:
            a2a.start_step("real", "comm")
            h = a2a.dispatch_a(hidden, topk, weights, capacity)
            a2a.combine_a(h, a2a.dispatch_b(h).x)
            a2a.combine_b(h)

    def exposed_latency(name: str, lat: float) -> float:
        for s in switches:
            s.real.slept_s, s.real.waits = 0.0, 0
        step(name)
        waits = sum(s.real.waits for s in switches)
        return sum(s.real.slept_s for s in switches) / (waits * lat / 1000.0) if lat > 0 and waits else 0.0

    same = step("serial", "record").next_token_ids == step("tbo", "record").next_token_ids
    variants = {"compute_ms": lambda: step("serial", "loopback"), "tbo_compute_ms": lambda: step("tbo", "loopback"),
                "comm_ms": comm_step, "serial_ms": lambda: step("serial"), "tbo_ms": lambda: step("tbo"),
                "sbo_ms": lambda: step("serial", sbo=True)}
    points = []
    for lat in latencies_ms:
        for s in switches:
            s.real.latency_s = lat / 1000.0
        point = {"batch_size": bs, "latency_ms": lat, "a2a_mode": a2a_mode,
                 **median_step_ms(groups, variants, warmup, iters),
                 "serial_latency_exposed": exposed_latency("serial", lat),
                 "tbo_latency_exposed": exposed_latency("tbo", lat), "tbo_same_tokens": same}
        points.append(point)
        if groups.world_rank == 0:
            print(f"  bs={bs:4d} latency={lat:4.1f} ms: compute {point['compute_ms']:.2f}, comm "
                  f"{point['comm_ms']:.2f}, serial {point['serial_ms']:.2f}, TBO {point['tbo_ms']:.2f} ms", flush=True)
    return points
