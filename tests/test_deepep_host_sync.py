"""DeepEP's normal-mode receive selects the received (token, local expert) pairs without a host sync: their count
is the sum of the ``num_recv_tokens_per_expert_list`` DeepEP's dispatch returns on the host, so ``dispatch_b`` runs
under ``HostSyncGuard`` (the ``nonzero`` it ran before reads the count back from the device once per prefill layer,
and fails this test).
Through the DeepEP double, on four ranks with an idle one; the outputs must equal the torch
dispatcher's."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_deepep_adapter import INTER, NUM_MAX, E, H, _experts, _inputs  # noqa: E402

from raymoe.config import ParallelConfig  # noqa: E402


def _normal_step_under_guard(groups, sizes: list[int]) -> dict:
    import deep_ep_double

    from raymoe.comm.dispatcher import A2ABackendSpec, TorchDispatcher
    from raymoe.platform.reference.sync_guard import HostSyncGuard
    from raymoe.platform.selector import reference_platform, select_platform

    deep_ep_double.install(deep_ep_double.RELAXED)
    experts = _experts(groups, torch.float32)
    x, ids, w = _inputs(groups.ep_rank, sizes[groups.ep_rank], torch.float32)
    outs = {}
    for name, a2a in (("torch", TorchDispatcher(groups, E, reference_platform())),
                      ("deepep", select_platform("cpu").create_dispatcher(
                          A2ABackendSpec("deepep", "normal", NUM_MAX), groups, E, H, torch.float32, INTER))):
        handle = a2a.dispatch_a(x, ids, w, None)
        with HostSyncGuard() if name == "deepep" else contextlib.nullcontext():  # every rank raises alike
            rows = a2a.dispatch_b(handle)
        a2a.combine_a(handle, experts.forward_input(rows))
        outs[name] = a2a.combine_b(handle)
    return {"diff": (outs["deepep"] - outs["torch"]).abs().max().item() if x.shape[0] else 0.0,
            "rows": outs["deepep"].shape[0]}


def test_deepep_normal_receive_needs_no_host_sync():
    from dist_harness import run_ranks

    sizes = [4, 0, 7, 2]
    per_rank = run_ranks(_normal_step_under_guard, ParallelConfig(tp_size=1, dp_size=4, ep_size=4), sizes)
    for r, out in enumerate(per_rank):
        assert out["rows"] == sizes[r] and out["diff"] <= 1e-5, (r, out)
