"""The sampler draws from the filtered, tempered model distribution; seeded rows do not depend on the batch."""

from __future__ import annotations

import torch

from raymoe.platform.selector import select_platform
from raymoe.runner.forward_batch import SamplingBatchInfo
from raymoe.runner.sampler import Sampler
from raymoe.step.sampling_inputs import SamplingInputs

CPU = select_platform("cpu")


def _info(bs: int, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seeds=None, output_lens=None):
    inputs = SamplingInputs(temperatures=[temperature] * bs, top_ps=[top_p] * bs, top_ks=[top_k] * bs,
                            min_ps=[min_p] * bs, seeds=seeds or [None] * bs, output_lens=output_lens or [0] * bs,
                            logprobs=[None] * bs)
    return SamplingBatchInfo.from_inputs(inputs, "cpu")


def _frequencies(logits: torch.Tensor, info, draws: int = 4000) -> torch.Tensor:
    sampler = Sampler(CPU, seed=1)
    rows = logits.expand(draws, -1).contiguous()
    ids, _ = sampler(rows, info)
    return torch.bincount(ids, minlength=logits.shape[-1]).float() / draws


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, float("-inf")]])
    for t in (1.0, 0.5):
        freq = _frequencies(logits, _info(4000, temperature=t))
        expected = torch.softmax(logits[0] / t, dim=-1)
        assert freq[4] == 0.0, "a zero-probability token was drawn"
        assert torch.allclose(freq, expected, atol=0.03), (t, freq, expected)


def test_filters_restrict_the_candidates():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert set(torch.nonzero(_frequencies(logits, _info(4000, top_k=2)))[:, 0].tolist()) == {0, 1}
    assert set(torch.nonzero(_frequencies(logits, _info(4000, top_p=0.7)))[:, 0].tolist()) == {0, 1}
    assert set(torch.nonzero(_frequencies(logits, _info(4000, min_p=0.4)))[:, 0].tolist()) == {0, 1}
    freq = _frequencies(logits, _info(4000, top_k=2))
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.03


def test_seeded_row_is_batch_invariant():
    torch.manual_seed(0)
    logits = torch.randn(5, 64)
    alone = Sampler(CPU, seed=0)(logits[2:3], _info(1, seeds=[7], output_lens=[3]))[0]
    batch = Sampler(CPU, seed=123)(logits, _info(5, seeds=[None, None, 7, None, None], output_lens=[0, 0, 3, 0, 0]))[0]
    assert batch[2].item() == alone[0].item()
