"""FP8 experts on CPU ranks dequantize only as many experts as a call has routed pairs, the routed ones among them
(``raymoe.platform.cpu.experts.routed_experts``): token rows (the routed-rows kernel, with other ranks' ids and
padding ids) and pair rows (with NO_EXPERT rows) give exactly the answer of dequantizing every local expert; a
one-token step converts its top-k experts only, without a host sync (graph capture); a call with as many pairs as
experts converts all of them once."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from raymoe.comm.expert_input import NO_EXPERT, ExpertRows, RoutedTokenRows
from raymoe.models.fp8_checkpoint import quantize_weight
from raymoe.platform.cpu.experts import routed_experts
from raymoe.platform.interface import BlockScales
from raymoe.platform.reference.fp8 import dense_experts
from raymoe.platform.reference.sync_guard import HostSyncGuard
from raymoe.platform.selector import select_platform

H, INTER, EL, FIRST = 64, 48, 8, 8


def _experts(seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)

    def quant(n, k):
        qs, ss = zip(*(quantize_weight(torch.randn(n, k, generator=g) / k ** 0.5, "block", (32, 32))
                       for _ in range(EL)), strict=True)
        return torch.stack(qs), BlockScales(torch.stack(ss), (32, 32))

    w13, s13 = quant(2 * INTER, H)
    w2, s2 = quant(H, INTER)
    return SimpleNamespace(w13=w13, w2=w2, prepared13=s13, prepared2=s2, num_local=EL, expert_start=FIRST)


class Counting:
    """The platform's ``weight_values``, counting the experts it converts."""

    def __init__(self, ops):
        self.ops, self.experts = ops, 0

    def __call__(self, weight, prepared, dtype):
        self.experts += weight.shape[0]
        return self.ops.weight_values(weight, prepared, dtype)


def test_token_rows_convert_only_their_routed_experts_and_answer_as_all():
    ops = select_platform("cpu")
    experts = _experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, H, generator=g)
    ids = torch.tensor([[[FIRST + 2, FIRST + 5], [FIRST + 2, 3], [FIRST + EL, FIRST + 5]]])  # other ranks, padding
    w = torch.rand(1, 3, 2, generator=g)
    rows = RoutedTokenRows(x, ids, w, FIRST)
    got = ops.expert_routed(rows, experts)
    want = ops.expert_routed(rows, dense_experts(experts, torch.float32, ops.weight_values))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    counting = Counting(ops)
    subset, renumbered = routed_experts(experts, ids - FIRST, torch.float32, counting)
    assert counting.experts == 2 * 6 and subset.num_local == 6  # as many as ids (6 < 8), both projections
    assert renumbered.tolist() == [[[0, 1], [0, -1], [-1, 1]]]  # experts 2 and 5 come first
    one = RoutedTokenRows(x[:, :1], ids[:, :1], w[:, :1], FIRST)  # a one-token step converts its 2 experts only
    counting.experts = 0
    routed_experts(experts, one.topk_ids - FIRST, torch.float32, counting)
    assert counting.experts == 2 * 2
    with HostSyncGuard():  # nothing read on the host: decode graphs capture it
        got = ops.expert_routed(one, experts)
    torch.testing.assert_close(got, ops.expert_routed(one, dense_experts(experts, torch.float32, ops.weight_values)),
                               rtol=0, atol=0)


def test_pair_rows_convert_only_their_experts_and_a_call_routing_to_all_converts_all():
    ops = select_platform("cpu")
    experts = _experts(2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, generator=g)
    ids = torch.tensor([1, 6, NO_EXPERT, 1, 6, 6])
    got = ExpertRows(x, ids).compute(ops, experts)
    want = ExpertRows(x, ids).compute(ops, dense_experts(experts, torch.float32, ops.weight_values))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bool((got[2] == 0).all())
    counting = Counting(ops)
    _, same = routed_experts(experts, torch.arange(EL), torch.float32, counting)
    assert counting.experts == 2 * EL and same.tolist() == list(range(EL))
