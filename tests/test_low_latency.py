"""Low-latency (fixed-shape) MoE dispatch/combine: the same result as the normal mode, on gloo ranks and through
whole engines (greedy tokens equal transformers' at ep=2 and ep=4, TBO on and off, decode graphs captured under
the host-sync guard)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raymoe import Engine, SamplingParams
from raymoe.comm.a2a_plan import child_dispatch_capacity, plan_dispatch_capacity
from raymoe.comm.dispatcher import TorchDispatcher
from raymoe.comm.expert_input import DenseExpertRows, GroupedExpertRows, RoutedTokenRows, resolve_a2a_mode
from raymoe.comm.groups import ParallelGroups
from raymoe.config import ParallelConfig
from raymoe.layers.moe import LocalExperts
from raymoe.platform.reference.platform import TorchPlatform
from raymoe.platform.selector import reference_platform, select_platform
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

E, K, H, INTER = 8, 2, 16, 12
REF, CPU = reference_platform(), select_platform("cpu")


class TokenRowsUpTo(TorchPlatform):
    """The reference platform with the token-row layout for steps of at most ``max_rows`` gathered token rows."""

    def __init__(self, max_rows: int):
        super().__init__()
        self.max_rows = max_rows

    def use_token_rows(self, ep_size, capacity, top_k, num_experts, expert_row_macs, hidden) -> bool:
        return ep_size * capacity <= self.max_rows


def _dispatcher(groups: ParallelGroups, token_rows_up_to: int = -1, expert_row_macs: int = 0,
                ops=None) -> TorchDispatcher:
    """A torch dispatcher whose layout picks token rows for steps of at most ``token_rows_up_to`` gathered rows
    (-1: never), or ``ops``'s choice."""
    return TorchDispatcher(groups, E, ops or TokenRowsUpTo(token_rows_up_to), expert_row_macs=expert_row_macs)


def _experts(groups: ParallelGroups) -> tuple[LocalExperts, torch.Tensor, torch.Tensor]:
    """This rank's experts, and every expert's weights (the same seed on all ranks) for the reference."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    local = LocalExperts(E, H, INTER, groups, torch.float32, CPU)
    start = local.expert_start
    local.w13.data.copy_(w13[start:start + local.num_local])
    local.w2.data.copy_(w2[start:start + local.num_local])
    return local, w13, w2


def _inputs(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else torch.empty(0, K).long()
    w = torch.softmax(torch.randn(n, K, generator=g), dim=-1)
    return x, ids, w


def _moe_both_modes(groups: ParallelGroups, sizes: list[int], skewed: bool = False) -> dict:
    """One MoE call per mode on this rank's tokens (``sizes[rank]`` of them; capacity = max over ranks).
    ``skewed``: every token picks experts 1 and 0, both on rank 0 (the fullest message a rank can send)."""
    n = sizes[groups.ep_rank]
    x, ids, w = _inputs(groups.ep_rank, n)
    if skewed:
        ids = torch.tensor([[1, 0]] * n, dtype=torch.int64).view(n, K)
    experts, w13, w2 = _experts(groups)
    a2a = _dispatcher(groups)  # the grouped layout at any size
    dense = _dispatcher(groups, token_rows_up_to=groups.ep_size * max(sizes))
    out = {}
    for mode, capacity, disp in (("normal", None, a2a), ("low_latency", max(sizes), a2a),
                                 ("dense", max(sizes), dense)):
        handle = disp.dispatch_a(x, ids, w, capacity)
        rows = disp.dispatch_b(handle)
        tokens = groups.ep_size * capacity if capacity else 0
        if isinstance(rows, GroupedExpertRows):  # packed expert after expert, sized by the capacity only
            ends = [0, *rows.ends.tolist()]
            out["counts"] = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]
            assert rows.x.shape == (tokens * K, H)  # every received pair, this rank's first
            assert rows.expert_capacity == tokens
        if isinstance(rows, RoutedTokenRows):  # every gathered token row once, with its own routing
            assert rows.x.shape == (groups.ep_size, capacity, H)
            assert rows.topk_ids.shape == (groups.ep_size, capacity, K)
            dense_rows = rows.dense(experts.num_local)                 # the torch path's weight per local expert
            assert dense_rows.x.shape == (tokens, H) and dense_rows.weights.shape == (tokens, experts.num_local)
            out["dense_counts"] = (dense_rows.weights != 0).sum(0).tolist()
        assert isinstance(rows, RoutedTokenRows) == (mode == "dense")
        disp.combine_a(handle, experts.forward_input(rows))
        out[mode] = disp.combine_b(handle)
    ref = torch.zeros(n, H)
    for t in range(n):
        for j in range(K):
            e = int(ids[t, j])
            hidden = torch.nn.functional.silu(w13[e, :INTER] @ x[t]) * (w13[e, INTER:] @ x[t])
            ref[t] += w[t, j] * (w2[e] @ hidden)
    out["reference"] = ref
    out["local_ids"] = ids
    # plain lists: tensors would cross the process boundary as shared-memory handles that die with the rank
    return {key: v.tolist() if isinstance(v, torch.Tensor) else v for key, v in out.items()}


@pytest.mark.parametrize(("sizes", "skewed"), [([5, 3], False), ([4, 0, 7, 2], False), ([5, 5], True)],
                         ids=["ep2", "ep4_with_idle_rank", "ep2_all_to_rank0"])
def test_low_latency_combine_equals_normal_mode_and_reference(sizes, skewed):
    from dist_harness import run_ranks

    ep = len(sizes)
    per_rank = run_ranks(_moe_both_modes, ParallelConfig(tp_size=1, dp_size=ep, ep_size=ep), sizes, skewed)
    el = E // ep
    per_rank = [{key: torch.tensor(v) for key, v in out.items()} for out in per_rank]
    for r, out in enumerate(per_rank):
        assert out["low_latency"].reshape(-1, H).shape == (sizes[r], H)
        low, dense, normal, ref = (out[key].reshape(-1, H) for key in ("low_latency", "dense", "normal", "reference"))
        torch.testing.assert_close(low, normal, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(low, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense, low, rtol=1e-5, atol=1e-6)  # other GEMM blocking: rounding differs
        # every rank's pairs for this rank's experts were counted, on the device, without an extra exchange
        expected = [sum(int((o["local_ids"] == r * el + e).sum()) for o in per_rank) for e in range(el)]
        assert out["counts"].tolist() == expected
        assert out["dense_counts"].tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["grouped_gemm", "masked_fallback"])
def test_experts_on_packed_rows_ignore_padding(dtype):
    """Segments of the packed layout go through their own expert, an empty expert included; padding rows (NaN
    here) leak into no valid row, on the grouped-GEMM path and on the masked fallback (float64 has no grouped
    GEMM)."""
    experts, w13, w2 = _experts(ParallelGroups.single())
    experts.to(dtype)
    counts = [3, 0, 4, 1, 2, 0, 0, 5]
    valid = sum(counts)
    x = torch.randn(valid + 6, H, dtype=dtype)
    x[valid:] = float("nan")
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = experts.forward_input(GroupedExpertRows(x, ends, expert_capacity=max(counts)))
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    w13, w2 = w13.to(dtype), w2.to(dtype)
    ref = torch.stack([w2[e] @ (torch.nn.functional.silu(w13[e, :INTER] @ x[i]) * (w13[e, INTER:] @ x[i]))
                       for i, e in enumerate(ids.tolist())])
    assert y.shape == x.shape
    torch.testing.assert_close(y[:valid], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_weight_every_row_and_ignore_padding(dtype):
    """The dense layout: each row gets the weighted sum of the experts it picked (zero weights elsewhere), and
    padding rows (NaN, all-zero weights) leak into no valid row."""
    experts, w13, w2 = _experts(ParallelGroups.single())
    experts.to(dtype)
    g = torch.Generator().manual_seed(5)
    valid = 6
    x = torch.randn(valid + 3, H, generator=g).to(dtype)
    x[valid:] = float("nan")
    weights = torch.zeros(valid + 3, E, dtype=dtype)
    picks = [torch.randperm(E, generator=g)[:K] for _ in range(valid)]
    for r, pick in enumerate(picks):
        weights[r, pick] = torch.softmax(torch.randn(K, generator=g), dim=0).to(dtype)
    y = experts.forward_input(DenseExpertRows(x, weights))
    assert y.shape == x.shape and y.dtype == dtype
    w13, w2, xf = w13.float(), w2.float(), x.float()
    ref = torch.stack([sum(float(weights[r, e]) * (w2[e] @ (torch.nn.functional.silu(w13[e, :INTER] @ xf[r])
                                                            * (w13[e, INTER:] @ xf[r]))) for e in picks[r].tolist())
                       for r in range(valid)])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(y[:valid].float(), ref, **tol)


@pytest.mark.parametrize("kernels", [False, True])
def test_cpu_cost_model_picks_token_rows_only_for_small_cpu_steps(kernels):
    """The CPU platform's layout (``raymoe.platform.cpu.expert_layout``) sizes the dense bound by the
    multiply-accumulates of the experts; above it, and for float16 (whose range a zero-weighted expert output could
    overflow), the grouped layout answers. Where the fused kernel takes float32 experts, token rows also answer up
    to ``ROUTED_KERNEL_ROWS_PER_EXPERT`` routed pairs per local expert; experts of unknown size never take them."""
    from raymoe.platform.cpu.expert_layout import (
        DENSE_EXPERT_MAC_BUDGET,
        ROUTED_KERNEL_ROWS_PER_EXPERT,
        dense_row_experts,
        use_token_rows,
    )
    from raymoe.platform.cpu.kernels import build

    if kernels and build.load() is None:
        pytest.skip("fused CPU kernels unavailable (no C compiler, or RAYMOE_CPU_KERNELS=0)")
    assert dense_row_experts(3 * 128 * 64) == DENSE_EXPERT_MAC_BUDGET // (3 * 128 * 64)
    assert dense_row_experts(3 * 2048 * 768) == 0  # a real model's experts never take the dense layout
    macs = DENSE_EXPERT_MAC_BUDGET // (E * 6)       # the dense bound admits 6 tokens of E local experts
    kernel_max = ROUTED_KERNEL_ROWS_PER_EXPERT * E // K      # most tokens per rank the kernel rule admits
    kernel_macs = 20_000                                      # above the dense bound at kernel_max, within the kernel's
    build.reset(enabled=kernels)
    try:
        kinds = [use_token_rows(1, capacity, K, E, m, torch.zeros(1, dtype=dtype))
                 for capacity, dtype, m in ((6, torch.float32, macs), (7, torch.float32, macs),
                                            (kernel_max, torch.float32, kernel_macs),
                                            (kernel_max + 1, torch.float32, kernel_macs),
                                            (6, torch.float16, macs), (6, torch.bfloat16, macs),
                                            (7, torch.bfloat16, macs), (1, torch.float32, 0))]
    finally:
        build.reset()
    assert kinds == [True, kernels, kernels, False, False, True, False, False]


def test_token_row_layout_bounded_by_the_experts_arithmetic():
    """The fused kernel's token-row layout stops at ``ROUTED_KERNEL_MAX_MACS`` of routed pairs: large experts go to
    the grouped layout (the packed GEMM) even within the pair bound; through a CPU platform dispatcher."""
    from raymoe.platform.cpu.expert_layout import ROUTED_KERNEL_MAX_MACS
    from raymoe.platform.cpu.kernels import build

    if build.load() is None:
        pytest.skip("fused CPU kernels unavailable (no C compiler, or RAYMOE_CPU_KERNELS=0)")
    capacity = 8                                              # 16 routed pairs at ep 1, top-2
    fits = ROUTED_KERNEL_MAX_MACS // (capacity * K)
    kinds = []
    for macs in (fits // 64, fits, fits + 1):
        disp = _dispatcher(ParallelGroups.single(), expert_row_macs=macs, ops=CPU)
        x, ids, w = _inputs(0, capacity)
        kinds.append(type(disp.dispatch_b(disp.dispatch_a(x, ids, w, capacity))).__name__)
    assert kinds == ["RoutedTokenRows", "RoutedTokenRows", "GroupedExpertRows"]


@pytest.mark.parametrize("capacity", [None, 6])
def test_dense_at_ep1_sends_nothing_and_equals_the_sorted_path(capacity):
    """With one EP rank a small CPU step keeps its tokens whole (no pair sort, no message) in either mode, and
    gives the sorted path's result."""
    experts, _, _ = _experts(ParallelGroups.single())
    sorted_path = _dispatcher(ParallelGroups.single())
    dense = _dispatcher(ParallelGroups.single(), token_rows_up_to=6)
    x, ids, w = _inputs(0, 6)
    outs = []
    for disp in (sorted_path, dense):
        h = disp.dispatch_a(x, ids, w, capacity)
        rows = disp.dispatch_b(h)
        assert isinstance(rows, RoutedTokenRows) == (disp is dense)
        disp.combine_a(h, experts.forward_input(rows))
        outs.append(disp.combine_b(h))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="capacity"):
        dense.dispatch_a(x, ids, w, 5)


def test_low_latency_at_ep1_and_capacity_checks():
    groups = ParallelGroups.single()
    experts, _, _ = _experts(groups)
    a2a = _dispatcher(groups)
    x, ids, w = _inputs(0, 6)
    results = []
    for capacity in (None, 6, 9):
        h = a2a.dispatch_a(x, ids, w, capacity)
        a2a.combine_a(h, experts.forward_input(a2a.dispatch_b(h)))
        results.append(a2a.combine_b(h))
    torch.testing.assert_close(results[1], results[0])
    torch.testing.assert_close(results[2], results[0])
    with pytest.raises(ValueError, match="capacity"):
        a2a.dispatch_a(x, ids, w, 5)
    h = a2a.dispatch_a(x, ids, w, 6)
    a2a.dispatch_b(h)
    with pytest.raises(ValueError, match="one part"):
        a2a.combine_a(h, torch.zeros(E, 6, H), part=0, num_parts=2)


@pytest.mark.parametrize(("dtype", "hidden"), [(torch.bfloat16, 3), (torch.float32, 5), (torch.float16, 12)])
def test_low_latency_message_layout_any_row_size(dtype, hidden):
    """Rows whose byte size is no multiple of 8 (the routing after them must stay int64-aligned): with identity
    experts the combine returns each token's weighted sum of itself, as the normal mode does."""
    a2a = _dispatcher(ParallelGroups.single())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
    w = torch.softmax(torch.randn(5, K, generator=g), dim=-1).to(dtype)
    outs = []
    for capacity in (None, 7):
        h = a2a.dispatch_a(x, ids, w, capacity)
        a2a.combine_a(h, a2a.dispatch_b(h).x.clone())
        outs.append(a2a.combine_b(h))
    assert outs[1].shape == (5, hidden) and outs[1].dtype == dtype
    torch.testing.assert_close(outs[1].float(), (x.float() * w.float().sum(1, keepdim=True)), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[1], outs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_and_device_message_packing_write_the_same_bytes(dtype):
    """The CPU platform writes messages by ``memmove``; the reference's tensor copies (CUDA's, on the device's
    stream) must lay out the same bytes."""
    from raymoe.comm.low_latency import TorchLowLatencyAllToAll

    host, device = (TorchLowLatencyAllToAll(ParallelGroups.single(), E, ops) for ops in (CPU, REF))
    for n, m, hidden in ((5, 7, 5), (7, 7, 16), (0, 3, 3)):
        x, ids, w = _inputs(0, n)
        x = torch.randn(n, hidden).to(dtype)
        geo = host.geometry(m, K, hidden, dtype, torch.device("cpu"))
        messages = [torch.zeros(geo.nbytes, dtype=torch.uint8) for _ in range(2)]
        host._pack(messages[0], geo, m, x, ids, w.to(dtype))
        device._pack(messages[1], geo, m, x, ids, w.to(dtype))
        assert torch.equal(messages[0], messages[1])
        assert messages[0][geo.ids_offset:geo.weights_offset].view(torch.int64)[n * K:].eq(E).all()


def _batch(mode: ForwardMode, n: int, graph_bs: int | None = None) -> ModelWorkerBatch:
    if mode == ForwardMode.IDLE:
        return ModelWorkerBatch.idle()
    ext = [1] * n if mode == ForwardMode.DECODE else [n]
    rows = n if mode == ForwardMode.DECODE else 1
    return ModelWorkerBatch(forward_mode=mode, input_ids=[1] * n, req_pool_indices=list(range(rows)),
                            seq_lens=[e + 3 for e in ext], prefix_lens=[3] * rows, extend_lens=ext,
                            out_cache_loc=list(range(1, n + 1)),
                            prefix_slots=[] if mode == ForwardMode.DECODE else [100, 101, 102],
                            sampling=SamplingInputs.greedy(rows), graph_bs=graph_bs)


def test_driver_plans_one_mode_and_capacity_for_every_rank():
    decode = [_batch(ForwardMode.DECODE, 5), _batch(ForwardMode.IDLE, 0)]
    extend = [_batch(ForwardMode.EXTEND, 40), _batch(ForwardMode.DECODE, 3)]
    assert plan_dispatch_capacity(decode, "auto", 64) == 5          # busiest group's tokens
    assert plan_dispatch_capacity(extend, "auto", 64) is None       # extend tokens: normal mode
    assert plan_dispatch_capacity(extend, "low_latency", 64) == 40
    assert plan_dispatch_capacity(extend, "low_latency", 32) is None  # above the bound: normal mode
    assert plan_dispatch_capacity(decode, "normal", 64) is None
    graphed = [_batch(ForwardMode.DECODE, 5, graph_bs=8), dataclasses.replace(_batch(ForwardMode.IDLE, 0), graph_bs=8)]
    assert plan_dispatch_capacity(graphed, "auto", 4) == 8          # the captured bucket, whatever the bound
    assert child_dispatch_capacity(9, ForwardMode.DECODE) == 5 == child_dispatch_capacity(9, ForwardMode.IDLE)
    assert child_dispatch_capacity(9, ForwardMode.EXTEND) == 9
    assert resolve_a2a_mode("auto", True) == "low_latency" and resolve_a2a_mode("auto", False) == "normal"
    # nothing to dispatch on one CPU rank: auto keeps the (sync-free) grouped path; CUDA needs fixed shapes
    cuda = select_platform("cuda")
    assert CPU.effective_a2a_mode("auto", 1) == "normal" and CPU.effective_a2a_mode("auto", 2) == "auto"
    assert cuda.effective_a2a_mode("auto", 1) == "auto" and CPU.effective_a2a_mode("low_latency", 1) == "low_latency"
    with pytest.raises(ValueError):
        resolve_a2a_mode("fast", True)
    with pytest.raises(ValueError, match="dispatch_capacity"):
        dataclasses.replace(_batch(ForwardMode.DECODE, 5), dispatch_capacity=4)


PROMPTS = ["def fib(n):", "import os\nimport sys\n\n", "class Foo(object):\n    def __init__(self, x):\n",
           "The quick brown fox jumps over the lazy dog. " * 2, "x", "return self._cache[key]"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
OPTS = {"max_running_requests": 8, "chunked_prefill_size": 32, "max_context_len": 256, "cuda_graph_max_bs": 4,
        "num_max_dispatch_tokens_per_rank": 64}
TBO = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}


@pytest.fixture(scope="module")
def oracle(tiny_model):
    from transformers import AutoModelForCausalLM

    from raymoe.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                              do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize(("ep", "mode", "tbo"), [(2, "normal", False), (2, "low_latency", False),
                                                  (2, "low_latency", True), (4, "low_latency", True),
                                                  (4, "auto", False)])
def test_engine_low_latency_greedy_matches_transformers(ray_cluster, tiny_model, oracle, ep, mode, tbo):
    with Engine(tiny_model, dp_size=ep, ep_size=ep, a2a_mode=mode, **OPTS, **(TBO if tbo else {})) as e:
        outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
        d = e.driver
        steps, ll_steps, graph_steps, tbo_steps = d.num_steps, d.num_low_latency_steps, d.num_graph_steps, \
            d.num_tbo_steps
    assert outs == oracle
    assert graph_steps > 0  # decode graphs were captured (under the sync guard when low-latency) and replayed
    assert (tbo_steps > 0) == tbo
    if mode == "normal":
        assert ll_steps == 0
    elif mode == "low_latency":
        assert ll_steps == steps  # every step fits the per-rank bound (64 >= the prefill chunk here)
    else:
        assert 0 < ll_steps < steps
