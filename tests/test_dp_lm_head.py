"""The LM head under attention data parallelism (tp=1, ep>1) is split by vocabulary over the EP group: every rank's
logits equal the replicated head's, with the shared row bound given (decode) or exchanged (extend), with unequal
and zero row counts (an IDLE rank), over shared memory and over gloo."""

from __future__ import annotations

import pytest
import torch

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ParallelConfig
from raymoe.layers.embedding import ParallelLMHead
from raymoe.platform.selector import select_platform
from tests.dist_harness import run_ranks

CPU = select_platform("cpu")

VOCAB, HIDDEN = 1001, 24  # a vocabulary that does not divide by the rank count: padded shard rows


def _weights() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


class _Reader:
    def __init__(self, w: torch.Tensor):
        self.w = w

    def shape(self, name):
        return self.w.shape

    def get_slice(self, name, dim, start, end, dtype):
        return self.w[start:end].to(dtype)


def _rank(groups: ParallelGroups, rows: list[int], bound: int | None) -> list:
    head = ParallelLMHead(VOCAB, HIDDEN, groups, torch.float32, CPU)
    assert head.split_over_dp and head.weight.shape[0] == -(-VOCAB // groups.ep_size)
    w = _weights()
    head.load(_Reader(w), "lm_head.weight")
    out = [head.weight.t().is_contiguous()]  # CPU float32: column-major storage (the CPU platform's preparation)
    for step, n in enumerate(rows[groups.ep_rank::groups.ep_size]):
        hidden = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(100 * step + groups.ep_rank))
        logits = head(hidden, bound)
        out.append(bool(logits.shape == (n, VOCAB) and torch.allclose(logits, hidden @ w.t(), atol=1e-5)))
    return out


@pytest.mark.parametrize("ep,cpu_comm", [(2, "auto"), (2, "gloo"), (3, "auto")])
@pytest.mark.parametrize("bound", [None, 5])
def test_dp_split_lm_head_equals_the_replicated_head(ep, cpu_comm, bound):
    # rows of each rank per step, interleaved by rank: (5, 2[, 0]), (0, 4[, 1]), (3, 3[, 3])
    per_step = [[5, 2, 0], [0, 4, 1], [3, 3, 3]]
    rows = [n for step in per_step for n in step[:ep]]
    results = run_ranks(_rank, ParallelConfig(tp_size=1, dp_size=ep, ep_size=ep), rows, bound, cpu_comm=cpu_comm)
    assert results == [[True] * (1 + len(per_step))] * ep


def test_tensor_parallel_and_single_rank_heads_are_not_split():
    head = ParallelLMHead(VOCAB, HIDDEN, ParallelGroups.single(), torch.float32, CPU)
    assert not head.split_over_dp and head.weight.shape[0] == VOCAB
    w = _weights()
    head.load(_Reader(w), "lm_head.weight")
    assert head.weight.t().is_contiguous() and torch.equal(head.weight, w)  # column-major, same values
    x = torch.randn(3, HIDDEN)
    assert torch.allclose(head(x, 7), x @ w.t(), atol=1e-5)


def test_lm_head_keeps_row_major_storage_outside_cpu_float32():
    head = ParallelLMHead(VOCAB, HIDDEN, ParallelGroups.single(), torch.bfloat16, CPU)
    head.load(_Reader(_weights()), "lm_head.weight")
    assert head.weight.is_contiguous()
