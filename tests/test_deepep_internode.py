"""The DeepEP adapter (``raymoe.platform.cuda.deepep``) at ep=16, two nodes of 8 GPUs, through the double's
internode path (``deep_ep_double_internode``): one spawn of 16 gloo ranks, each on the node the placement plan
gives it (``deep_ep_double_core.simulate_node``), runs

1. the ranks on nodes in an interleaved order (rank r on node r % 2, as 16 one-bundle placement groups bound in list
   order could put them): building the adapter's buffer is refused, as DeepEP's ``cudaIpcOpenMemHandle`` of the
   NVLink peers 0-7 fails;
2. the ranks on the nodes of the node-ordered plan (``plan_gpu_ranks``: rank r on node r // 8): dispatch and
   combine in normal mode (the internode kernels) and low-latency mode, two TBO-like handles in flight, single-batch
   overlap parts, an idle rank, each equal to the torch dispatcher's results;
3. DeepEP's state across a decode-graph replay: low-latency kernels captured, then a normal-mode (internode) step
   leaves the low-latency buffer dirty; a replay without ``prepare_graph_replay`` would clean it from the host inside
   the replay, which a GPU replay does not run (refused), and with it the replay makes its captured calls and gives
   the eager results.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from raymoe.config import ParallelConfig  # noqa: E402
from raymoe.platform.selector import reference_platform, select_platform  # noqa: E402

EP, E, K, H, INTER, NUM_MAX = 16, 32, 2, 16, 16, 8
SIZES = [3, 0, 5, 2, 4, 1, 6, 2, 8, 3, 1, 2, 5, 7, 2, 4]  # tokens per rank: rank 1 idle, rank 8 at NUM_MAX


def _experts(groups):
    from raymoe.layers.moe import LocalExperts

    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2
    local = LocalExperts(E, H, INTER, groups, torch.float32, select_platform("cpu"))
    s = local.expert_start
    local.w13.data.copy_(w13[s:s + local.num_local])
    local.w2.data.copy_(w2[s:s + local.num_local])
    return local


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    n = SIZES[rank]
    x = torch.randn(n, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else torch.empty(0, K).long()
    return x, ids, torch.softmax(torch.randn(n, K, generator=g), dim=-1)


def _round_trip(a2a, experts, children, capacity, num_parts=1):
    """Both children's MoE calls with both handles in flight (a TBO-like order); the combined rows [N, H]."""
    from raymoe.comm.all_to_all import part_row_index

    handles = [a2a.dispatch_a(*child, capacity) for child in children]
    for h in handles:
        y = experts.forward_input(a2a.dispatch_b(h))
        for p in range(num_parts):
            part = y if num_parts == 1 else y[part_row_index(h.recv_counts, p, num_parts)]
            a2a.combine_a(h, part, **({} if num_parts == 1 else {"part": p, "num_parts": num_parts}))
    return torch.cat([a2a.combine_b(h) for h in handles])


def _refused(fn, match: str) -> str:
    from deep_ep_double_core import DoubleMisuse

    try:
        fn()
    except DoubleMisuse as e:
        return "refused" if match in str(e) else f"other error: {e}"
    return "accepted"


def _ep16(groups) -> dict:
    import deep_ep_double
    import deep_ep_double_graph as graph
    from deep_ep_double_core import simulate_node

    from raymoe.cluster.rank_plan import nvlink_domain, plan_gpu_ranks
    from raymoe.comm.dispatcher import A2ABackendSpec, TorchDispatcher
    from raymoe.platform.cuda import deepep_buffer

    deep_ep_double.install(deep_ep_double.RELAXED)  # float32 rows, hidden 16: exact comparisons
    platform, rank = select_platform("cpu"), groups.ep_rank
    spec = A2ABackendSpec("deepep", "auto", NUM_MAX)
    out = {}

    simulate_node(f"node-{rank % 2}")
    out["interleaved"] = _refused(lambda: platform.create_dispatcher(spec, groups, E, H, torch.float32, INTER),
                                  "cudaIpcOpenMemHandle fails: ranks 0-7 are one NVLink domain")
    deepep_buffer._REGISTRY.clear()

    plan = plan_gpu_ranks({"node-0": 8.0, "node-1": 8.0}, ParallelConfig(dp_size=EP, ep_size=EP),
                          nvlink_domain("deepep", EP))
    simulate_node(f"node-{plan.slots[rank].node}")
    experts = _experts(groups)
    x, ids, w = _inputs(rank)
    cut = x.shape[0] // 2
    children = [(x[:cut], ids[:cut], w[:cut]), (x[cut:], ids[cut:], w[cut:])]
    torch_a2a = TorchDispatcher(groups, E, reference_platform())
    deep = platform.create_dispatcher(spec, groups, E, H, torch.float32, INTER)
    cap = max(SIZES)
    for mode, capacity, parts in (("normal", None, 1), ("sbo_parts", None, 2), ("low_latency", cap, 1),
                                  ("normal_again", None, 1), ("low_latency_again", cap, 1)):
        ref = _round_trip(torch_a2a, experts, children, capacity)
        got = _round_trip(deep, experts, children, capacity, parts)
        out[mode] = (tuple(got.shape), (got - ref).abs().max().item() if got.numel() else 0.0)
    h = deep.dispatch_a(x, ids, w)
    out["normal_handle"] = [(tuple(t.shape), t.dtype) for t in h.deepep_handle]
    deep.combine_a(h, experts.forward_input(deep.dispatch_b(h)))
    deep.combine_b(h)

    # 3. a decode graph's low-latency kernels across a normal-mode step (the buffer is in low-latency mode now)
    eager = _round_trip(deep, experts, [(x, ids, w)], cap)
    with graph.graph_section("capture", 1600):
        _round_trip(deep, experts, [(x, ids, w)], cap)
    _round_trip(deep, experts, [(x, ids, w)], None)  # a prefill step: the internode kernels dirty the buffer

    def replay():
        with graph.graph_section("replay", 1600):
            return _round_trip(deep, experts, [(x, ids, w)], cap)

    out["replay_without_prepare"] = _refused(replay, "a graph replay calls clean_low_latency_buffer")
    deep.prepare_graph_replay()  # on the host, before the replay: cleans after the normal-mode step
    replayed = replay()
    out["replay"] = (replayed - eager).abs().max().item() if eager.numel() else 0.0
    out["captured"] = [c.split("@")[0] for c in graph._RECORDED[1600]]
    return out


def test_deepep_adapter_at_ep16_on_two_nodes_of_eight():
    from dist_harness import run_ranks

    per_rank = run_ranks(_ep16, ParallelConfig(dp_size=EP, ep_size=EP), timeout_s=900)
    nodes, channels = 2, 10  # Buffer.num_sms 20: 10 channels
    for r, out in enumerate(per_rank):
        assert out["interleaved"] == "refused", (r, out["interleaved"])
        for mode in ("normal", "sbo_parts", "low_latency", "normal_again", "low_latency_again"):
            shape, diff = out[mode]
            assert shape == (SIZES[r], H) and diff <= 1e-5, (r, mode, shape, diff)
        handle = out["normal_handle"]
        n = SIZES[r]
        assert len(handle) == 10  # DeepEP's internode handle, not the intranode 6-tuple
        assert handle[:3] == [((n, EP), torch.bool), ((nodes, channels), torch.int32), ((EP, channels), torch.int32)]
        assert handle[4] == ((nodes,), torch.int32) and handle[6] == ((EP,), torch.int32)
        assert handle[7][0][1] == 8 and handle[7][1] == torch.uint8 and handle[8] == ((n, nodes), torch.int32)
        assert handle[9][0][1] == 8 and handle[9][1] == torch.int32  # send_nvl_head [tokens in the RDMA buffer, 8]
        assert out["replay_without_prepare"] == "refused", (r, out["replay_without_prepare"])
        assert out["replay"] <= 1e-6, (r, out["replay"])
        assert out["captured"] == ["low_latency_dispatch", "low_latency_combine"]
