"""The DeepEP dispatcher (``raymoe.platform.cuda.deepep``) through a CPU conformance double of ``deep_ep``
(``deep_ep_double``): the same results as the torch dispatcher on gloo ranks (ep=2 and ep=4 with an idle rank,
normal and low-latency modes, two TBO-like handles in flight, single-batch-overlap parts), the same greedy tokens
through ModelRunners at ep=2, and loud failures on misuse (of the adapter and of the double)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from raymoe.config import ParallelConfig  # noqa: E402
from raymoe.platform.selector import reference_platform, select_platform  # noqa: E402

E, K, H, INTER = 8, 2, 16, 16  # INTER * 2 bytes % 16 == 0: bf16 grouped GEMM strides
NUM_MAX = 8
#: bfloat16 deepep vs torch outputs, relative to max(|output|, 1). Measured: 0.0039 at most (rank 0, low-latency,
#: |output| up to 1.10: half a bfloat16 ulp there), 0.0020 elsewhere. Tolerance: one bfloat16 ulp at [1, 2)
#: (2**-7 = 0.0078), 2x the measured maximum.
BF16_TOL = 2.0**-7


def _experts(groups, dtype):
    from raymoe.layers.moe import LocalExperts

    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2
    local = LocalExperts(E, H, INTER, groups, dtype, select_platform("cpu"))
    s = local.expert_start
    local.w13.data.copy_(w13[s:s + local.num_local])
    local.w2.data.copy_(w2[s:s + local.num_local])
    return local


def _inputs(rank: int, n: int, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else torch.empty(0, K).long()
    return x, ids, torch.softmax(torch.randn(n, K, generator=g), dim=-1).to(dtype)


def _tbo_pair(a2a, experts, children, capacity, num_parts=1):
    """Both children's MoE calls with both handles in flight, in a decode-like TBO order."""
    ha = a2a.dispatch_a(*children[0], capacity)
    hb = a2a.dispatch_a(*children[1], capacity)
    outs = []
    for h in (ha, hb):
        rows = a2a.dispatch_b(h)
        y = experts.forward_input(rows)
        if num_parts == 1:
            a2a.combine_a(h, y)
        else:
            from raymoe.comm.all_to_all import part_row_index

            for p in range(num_parts):
                a2a.combine_a(h, y[part_row_index(h.recv_counts, p, num_parts)], part=p, num_parts=num_parts)
    for h in (ha, hb):
        outs.append(a2a.combine_b(h))
    return torch.cat(outs)


def _compare(groups, sizes: list[int], dtype_name: str, limits_name: str) -> dict:
    """Per mode, the max |deepep - torch| of both children's outputs on this rank (plus shapes seen)."""
    import deep_ep_double

    from raymoe.comm.dispatcher import A2ABackendSpec, TorchDispatcher

    dtype = getattr(torch, dtype_name)
    deep_ep_double.install(getattr(deep_ep_double, limits_name))
    experts = _experts(groups, dtype)
    x, ids, w = _inputs(groups.ep_rank, sizes[groups.ep_rank], dtype)
    cut = x.shape[0] // 2
    children = [(x[:cut], ids[:cut], w[:cut]), (x[cut:], ids[cut:], w[cut:])]
    ref_a2a = TorchDispatcher(groups, E, reference_platform())
    deep = select_platform("cpu").create_dispatcher(A2ABackendSpec("deepep", "auto", NUM_MAX), groups, E, H, dtype,
                                                    INTER)
    out = {"in_flight_max": 0}
    for mode, capacity, parts in (("normal", None, 1), ("sbo_parts", None, 2), ("low_latency", max(sizes), 1),
                                  ("normal_again", None, 1), ("low_latency_again", max(sizes), 1)):
        ref = _tbo_pair(ref_a2a, experts, children, capacity)
        got = _tbo_pair(deep, experts, children, capacity, parts)
        out[mode] = (tuple(got.shape), (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0,
                     ref.double().abs().max().item() if ref.numel() else 0.0)
    h = deep.dispatch_a(*children[0], max(sizes))
    out["ll_rows_shape"] = tuple(deep.dispatch_b(h).x.shape)
    deep.combine_a(h, experts.forward_input(h.result))
    deep.combine_b(h)
    assert deep.shared.num_low_latency_in_flight == 0
    return out


def _ep2_checks(groups) -> dict:
    """fp32 and bf16 comparisons, then the misuse checks, on one pair of ranks (one spawn)."""
    from raymoe.platform.cuda import deepep_buffer

    out = {"fp32": _compare(groups, [5, 3], "float32", "RELAXED")}
    deepep_buffer._REGISTRY.clear()  # a process builds one model; these scenarios build three
    out["bf16"] = _compare(groups, [6, 3], "bfloat16", "BF16_ANY_H")
    deepep_buffer._REGISTRY.clear()
    out["misuse"] = _misuse(groups)
    return out


def _raises(fn, exc, match: str) -> bool:
    try:
        fn()
    except exc as e:
        return match in str(e)
    return False


def _misuse(groups) -> dict:
    """Which misuse each layer refuses: True when it raised the expected error (every rank runs the same calls,
    and nothing that raises has posted a collective)."""
    import deep_ep_double as dd
    from deep_ep_double_core import DoubleMisuse

    from raymoe.comm.expert_input import MaskedExpertRows
    from raymoe.platform.cuda.deepep import DeepEPDispatcher
    from raymoe.platform.cuda.deepep_buffer import DeepEPInFlightError

    experts = _experts(groups, torch.float32)
    x, ids, w = _inputs(groups.ep_rank, 3, torch.float32)
    deep = DeepEPDispatcher(groups, E, hidden_size=H, dtype=torch.float32, num_max_dispatch_tokens_per_rank=NUM_MAX,
                            buffer_factory=dd.buffer_class(dd.RELAXED))
    found = {"capacity_above_buffer": _raises(lambda: deep.dispatch_a(x, ids, w, NUM_MAX + 1), ValueError,
                                              "num_max_dispatch_tokens_per_rank")}
    h1, h2 = deep.dispatch_a(x, ids, w, 4), deep.dispatch_a(x, ids, w, 4)
    found["third_ll_in_flight"] = _raises(lambda: deep.dispatch_a(x, ids, w, 4), DeepEPInFlightError, "third")
    for h in (h1, h2):
        deep.combine_a(h, experts.forward_input(deep.dispatch_b(h)))
    found["drained"] = all(torch.equal(deep.combine_b(h1), deep.combine_b(h)) for h in (h2,))

    nvl, rdma = 1 << 20, dd.Buffer.get_low_latency_rdma_size_hint(NUM_MAX, H, groups.ep_size, E)
    strict = dd.buffer_class(dd.STRICT)(groups.ep_group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E)
    found["strict_rejects_fp32"] = _raises(lambda: strict.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False),
                                           DoubleMisuse, "bfloat16")
    found["strict_rejects_hidden_16"] = _raises(
        lambda: strict.low_latency_dispatch(x.bfloat16(), ids, NUM_MAX, E, use_fp8=False), DoubleMisuse, "hidden")
    buf = dd.buffer_class(dd.RELAXED)(groups.ep_group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=E)
    recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False,
                                                              return_recv_hook=True)
    found["read_before_hook"] = _raises(lambda: recv_x + 1, DoubleMisuse, "before it was received")
    found["combine_before_hook"] = _raises(lambda: buf.low_latency_combine(
        torch.zeros_like(recv_x), ids, w, handle), DoubleMisuse, "before it was received")
    d2 = buf.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False, return_recv_hook=True)
    found["double_third_in_flight"] = _raises(
        lambda: buf.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False, return_recv_hook=True), DoubleMisuse,
        "third low-latency result")
    hook()
    found["hook_twice"] = _raises(hook, DoubleMisuse, "twice")
    d2[4]()
    y = MaskedExpertRows(recv_x, count, recv_x.shape[0] * recv_x.shape[1]).compute(experts.ops, experts)
    found["combine_other_topk"] = _raises(lambda: buf.low_latency_combine(y, ids.flip(1).contiguous(), w, handle),
                                          DoubleMisuse, "not the one of this dispatch")
    found["ll_rows_beyond_count_are_nan"] = bool(torch.isnan(recv_x[0, int(count[0]):]).all())
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    recv, *_, event = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                   num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w,
                                   async_finish=True)
    found["read_before_event"] = _raises(lambda: recv.sum(), DoubleMisuse, "current_stream_wait")
    event.current_stream_wait()
    found["ll_after_normal_needs_clean"] = _raises(
        lambda: buf.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False), DoubleMisuse, "clean_low_latency")
    buf.clean_low_latency_buffer(NUM_MAX, H, E)
    found["ll_after_clean"] = buf.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False)[1].dtype == torch.int32
    found.update(_strict_limits(groups, buf, x, ids, w))
    return found


def _strict_limits(groups, buf, x, ids, w) -> dict:
    """The limits, layouts and graph rules of the real library that the double enforces (DeepEP v1.2.1; see
    ``deep_ep_double_core``): each refused before any collective, so the ranks stay in step."""
    import deep_ep_double_graph as graph
    from deep_ep_double_core import DoubleMisuse

    def padded(k: int) -> tuple[torch.Tensor, torch.Tensor]:  # ids [N, k]: the real top-2, then -1 (no expert)
        wide = torch.full((ids.shape[0], k), -1, dtype=torch.int64)
        wide[:, :2] = ids
        return wide, torch.zeros(ids.shape[0], k).index_copy_(1, torch.arange(2), w)

    found = {}
    ids12, _ = padded(12)
    found["ll_topk_above_11"] = _raises(lambda: buf.low_latency_dispatch(x, ids12, NUM_MAX, E, use_fp8=False),
                                        DoubleMisuse, "kNumMaxTopK 11")
    ids33, w33 = padded(33)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids33, E)
    found["normal_topk_above_32"] = _raises(lambda: buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids33,
        topk_weights=w33), DoubleMisuse, "num_topk 33 > 32")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    strided = in_rank.t().contiguous().t()  # the same values, not contiguous
    found["token_in_rank_not_contiguous"] = _raises(lambda: buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=strided, num_tokens_per_expert=per_expert, topk_idx=ids,
        topk_weights=w), DoubleMisuse, "is_token_in_rank: contiguous")
    found["expert_id_out_of_range"] = _raises(lambda: buf.get_dispatch_layout(torch.full_like(ids, E), E),
                                              DoubleMisuse, "topk_idx outside")
    with pytest.raises(DoubleMisuse, match="cannot be captured"), graph.graph_section("capture", -1):
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=ids, topk_weights=w)
    found["normal_dispatch_not_capturable"] = True
    with graph.graph_section("capture", -2):  # a captured low-latency dispatch, received in the graph
        buf.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False, return_recv_hook=True)[4]()
    found["replay_with_a_host_clean"] = _raises(lambda: _replay(-2, lambda: buf.clean_low_latency_buffer(
        NUM_MAX, H, E)), DoubleMisuse, "a graph replay calls clean_low_latency_buffer")
    found["replay_missing_a_kernel"] = _raises(lambda: _replay(-2, lambda: None), DoubleMisuse, "0 of the 1")

    def ll_received() -> None:
        buf.low_latency_dispatch(x, ids, NUM_MAX, E, use_fp8=False, return_recv_hook=True)[4]()

    # the capture's kernel used the other low-latency buffer: DeepEP's replay would not restore it
    found["replay_on_the_other_buffer"] = _raises(lambda: _replay(-2, ll_received), DoubleMisuse, "@buffer")
    ll_received()  # an eager kernel brings the buffers back to where the capture began
    _replay(-2, ll_received)
    found["replay_like_capture"] = True
    return found


def _replay(key: int, calls) -> None:
    import deep_ep_double_graph as graph

    with graph.graph_section("replay", key):
        calls()


def test_deepep_adapter_equals_torch_dispatcher_ep2_and_refuses_misuse():
    from dist_harness import run_ranks

    per_rank = run_ranks(_ep2_checks, ParallelConfig(tp_size=1, dp_size=2, ep_size=2))
    for r, out in enumerate(per_rank):
        for mode in ("normal", "sbo_parts", "low_latency", "normal_again", "low_latency_again"):
            shape, diff, scale = out["fp32"][mode]
            assert shape == ([5, 3][r], H) and diff <= 1e-5 * max(scale, 1.0), (r, mode, diff)
            _, diff, scale = out["bf16"][mode]  # bfloat16: DeepEP's dtype; rounding differs from the torch path
            assert diff <= BF16_TOL * max(scale, 1.0), (r, mode, diff, scale)
        assert out["fp32"]["ll_rows_shape"] == (E // 2, NUM_MAX * 2, H)  # sized by the buffer's M_max
        assert all(out["misuse"].values()), out["misuse"]


def test_deepep_adapter_equals_torch_dispatcher_ep4_with_idle_rank():
    from dist_harness import run_ranks

    sizes = [4, 0, 7, 2]
    per_rank = run_ranks(_compare, ParallelConfig(tp_size=1, dp_size=4, ep_size=4), sizes, "float32", "RELAXED")
    for r, out in enumerate(per_rank):
        for mode in ("normal", "sbo_parts", "low_latency", "normal_again", "low_latency_again"):
            shape, diff, scale = out[mode]
            assert shape == (sizes[r], H) and diff <= 1e-5 * max(scale, 1.0), (r, mode, diff)
        assert out["ll_rows_shape"] == (E // 4, NUM_MAX * 4, H)


def test_deepep_backend_needs_deep_ep_and_an_ep_group(monkeypatch):
    from raymoe.comm.dispatcher import A2ABackendSpec
    from raymoe.comm.groups import ParallelGroups

    monkeypatch.setitem(sys.modules, "deep_ep", None)  # "not installed"
    fake = ParallelGroups(world_size=2, dp_size=2, ep_size=2, ep_group=object())
    platform = select_platform("cpu")
    with pytest.raises(ImportError, match="deep_ep"):
        platform.create_dispatcher(A2ABackendSpec("deepep"), fake, E, H, torch.bfloat16, INTER)
    with pytest.raises(ValueError, match="ep_size"):
        platform.create_dispatcher(A2ABackendSpec("deepep"), ParallelGroups.single(), E, H, torch.bfloat16, INTER)
    with pytest.raises(ValueError, match="unknown all-to-all backend"):
        platform.create_dispatcher(A2ABackendSpec("nccl_ep"), fake, E, H, torch.bfloat16, INTER)


def _greedy_runs(groups, path: str) -> dict:
    """Greedy decoding of this DP group's requests with torch and deepep runners (and deepep with TBO): a prefill
    (normal mode) then decode steps (low-latency, one capacity for both ranks); per runner the tokens and logits."""
    import deep_ep_double

    from raymoe.comm.a2a_plan import plan_dispatch_capacity
    from raymoe.config import GraphConfig, MoeCommConfig, OverlapConfig
    from raymoe.overlap.decision import decide_tbo
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig
    from raymoe.step.forward_mode import ForwardMode
    from raymoe.step.sampling_inputs import SamplingInputs
    from raymoe.step.worker_batch import ModelWorkerBatch

    deep_ep_double.install(deep_ep_double.RELAXED)  # float32 rows and hidden 128: see deep_ep_double.Limits
    tbo = OverlapConfig(enable_tbo=True, tbo_min_tokens_decode=2, tbo_min_tokens_extend=4)
    runners = {name: ModelRunner(RunnerConfig(path, "float32", num_kv_slots=256, max_req_rows=4, max_context_len=64,
                                              moe_comm=MoeCommConfig(backend, "auto", 4),
                                              graph=GraphConfig(disable_cuda_graph=True), overlap=overlap), groups)
               for name, backend, overlap in (("torch", "torch", OverlapConfig()),
                                              ("deepep", "deepep", OverlapConfig()), ("deepep_tbo", "deepep", tbo))}
    from raymoe.layers.moe import SparseMoeBlock
    from raymoe.platform.cuda.deepep import DeepEPDispatcher

    blocks = [m for m in runners["deepep_tbo"].model.modules() if isinstance(m, SparseMoeBlock)]
    shared = {id(m.a2a.shared) for m in blocks if isinstance(m.a2a, DeepEPDispatcher)}
    prompts = {0: [[5, 6, 7, 8, 9], [300, 301, 302]], 1: [[42] * 9, [7, 8], [11, 12, 13, 14]]}
    tokens = {g: [list(p) for p in ps] for g, ps in prompts.items()}

    def batches(step: int) -> dict:
        out = {}
        for g, seqs in tokens.items():
            if step == 0:
                ids = [t for s in seqs for t in s]
                lens = [len(s) for s in seqs]
                out[g] = ModelWorkerBatch(ForwardMode.EXTEND, ids, list(range(len(seqs))), lens, [0] * len(seqs),
                                          lens, [1 + 64 * r + i for r, n in enumerate(lens) for i in range(n)],
                                          sampling=SamplingInputs.greedy(len(seqs)))
            else:
                lens = [len(s) for s in seqs]
                out[g] = ModelWorkerBatch(ForwardMode.DECODE, [s[-1] for s in seqs], list(range(len(seqs))), lens,
                                          [n - 1 for n in lens], [1] * len(seqs), [64 * r + n for r, n in
                                                                                  enumerate(lens)],
                                          sampling=SamplingInputs.greedy(len(seqs)))
        cap = plan_dispatch_capacity(list(out.values()), "auto", 4)
        use_tbo = decide_tbo(list(out.values()), tbo)
        return {g: (b, cap, use_tbo) for g, b in out.items()}

    result = {name: {"tokens": [], "logits": []} for name in runners}
    result["plan"], result["deepep_layers"] = [], (len(blocks), len(shared))
    for step in range(5):
        mine, cap, use_tbo = batches(step)[groups.dp_rank]
        result["plan"].append((cap, use_tbo))
        for name, runner in runners.items():
            import dataclasses

            b = dataclasses.replace(mine, dispatch_capacity=cap, use_tbo=use_tbo and name == "deepep_tbo")
            logits = runner.forward(runner.prepare(b))
            ref = result["torch"]["logits"][-1] if name != "torch" else logits
            result[name]["logits"].append((logits - ref).abs().max().item() if name != "torch" else logits)
            result[name]["tokens"].append(logits.argmax(-1).tolist())
        for s, t in zip(tokens[groups.dp_rank], result["torch"]["tokens"][-1], strict=True):
            s.append(t)
        for g in tokens:  # the other group's sequences grow too (only their lengths matter for the plan)
            if g != groups.dp_rank:
                for s in tokens[g]:
                    s.append(0)
    result["torch"]["logits"] = []  # tensors do not travel back from the rank processes; the diffs do
    return result


def test_model_runners_with_deepep_double_match_torch_greedy_ep2(tiny_model):
    """ModelRunners built with ``a2a_backend="deepep"`` (the engine's config check refuses deepep without CUDA, so
    the runners are built directly, with the double as ``deep_ep``) decode the tokens of ``"torch"`` runners."""
    from dist_harness import run_ranks

    per_rank = run_ranks(_greedy_runs, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), tiny_model)
    for out in per_rank:
        assert out["plan"][0][0] is None and all(cap is not None for cap, _ in out["plan"][1:])  # normal, then LL
        assert any(use_tbo for _, use_tbo in out["plan"])
        assert out["deepep_layers"][0] >= 2 and out["deepep_layers"][1] == 1  # every layer, one shared buffer
        for name in ("deepep", "deepep_tbo"):
            assert out[name]["tokens"] == out["torch"]["tokens"], name
            assert max(out[name]["logits"]) <= 1e-4, (name, out[name]["logits"])  # max |logit diff| per step
