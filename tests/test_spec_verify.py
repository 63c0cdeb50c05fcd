"""Speculative decoding's acceptance on the rank (``raymoe.runner.spec_verify``) and n-gram drafts
(``raymoe.scheduler.ngram``): greedy acceptance by exact match, and rejection sampling whose output distribution is
the target's (a chi-square test that a biased acceptance rule fails)."""

from __future__ import annotations

import pytest
import torch

from raymoe.platform.selector import select_platform
from raymoe.runner import spec_verify
from raymoe.runner.forward_batch import SamplingBatchInfo
from raymoe.runner.sampler import seeded_uniform
from raymoe.runner.spec_verify import verify_drafts
from raymoe.scheduler.ngram import propose_ngram
from raymoe.step.sampling_inputs import SamplingInputs

OPS = select_platform(torch.device("cpu"), torch.float32)
# chi-square critical values at p = 0.001 by degrees of freedom (a correct sampler fails 1 run in 1000)
CHI2_999 = {2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def info(bs: int, temperature: float = 0.0, top_k: int = -1, seeds=None, output_lens=None) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_inputs(SamplingInputs(
        temperatures=[temperature] * bs, top_ps=[1.0] * bs, top_ks=[top_k] * bs, min_ps=[0.0] * bs,
        seeds=seeds or [None] * bs, output_lens=output_lens or [0] * bs, logprobs=[None] * bs), "cpu")


def one_hot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.full((len(targets), vocab), -5.0)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def test_ngram_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 1, 3) == [4, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2], 4, 1, 3) == [3, 4, 5, 1]  # [5,1,2] never seen: [1,2]
    assert propose_ngram([7, 1, 9, 1, 8, 1], 2, 1, 1) == [8, 1]  # the most recent occurrence of [1]
    assert propose_ngram([5, 6, 7], 2, 1, 3) == []
    assert propose_ngram([1, 2, 1, 2], 0, 1, 3) == []
    # token ids whose 4-byte encodings overlap must match at token boundaries only
    assert propose_ngram([256, 1, 0, 0, 1], 2, 1, 2) == [0, 0]
    assert propose_ngram([1 << 8, 1 << 16, 5, 1], 2, 1, 1) == []


def test_greedy_accepts_the_agreeing_prefix_and_adds_the_targets_token():
    # row 0: [x, 3, 4, 5] and the target predicts 3, 4, 6, 2: two drafts accepted, then 6
    # row 1: [x, 1] and the target predicts 2, 7: nothing accepted, then 2
    # row 2: [x] (no draft): the target's token 5
    # row 3: [x, 2, 2] and the target predicts 2, 2, 1: both accepted, then 1
    ids = torch.tensor([0, 3, 4, 5, 0, 1, 0, 0, 2, 2])
    logits = one_hot_logits([3, 4, 6, 2, 2, 7, 5, 2, 2, 1])
    res = verify_drafts(OPS, logits, ids, [4, 2, 1, 3], info(4), torch.Generator().manual_seed(0))
    assert res.accept_lens.tolist() == [2, 0, 0, 2]
    assert res.next_ids.tolist() == [6, 2, 5, 1]


def test_verify_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="extend lengths"):
        verify_drafts(OPS, torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64), [2, 2], info(2), torch.Generator())


TARGET = [torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3]), torch.tensor([0.1, 1.5, -0.5, 0.7, 0.0, 1.0])]
DRAFT = [1, 3]  # drafts of positions 1 and 2 (neither the target's most likely token)


def sample_many(n: int, temperature: float, top_k: int, seed: int = 0):
    """``n`` identical rows ``[x, 1, 3]`` whose positions 0 and 1 have the TARGET distributions: the first two
    tokens each row emits."""
    logits = torch.stack([TARGET[0], TARGET[1], TARGET[1]] * n)
    ids = torch.tensor([0, DRAFT[0], DRAFT[1]] * n)
    res = verify_drafts(OPS, logits, ids, [3] * n, info(n, temperature, top_k), torch.Generator().manual_seed(seed))
    acc, nxt = res.accept_lens.tolist(), res.next_ids.tolist()
    first = [DRAFT[0] if a >= 1 else t for a, t in zip(acc, nxt, strict=True)]
    second = [(DRAFT[1] if a >= 2 else t) for a, t in zip(acc, nxt, strict=True) if a >= 1]
    return first, second


def target_probs(pos: int, temperature: float, top_k: int) -> torch.Tensor:
    p = torch.softmax(TARGET[pos] / temperature, dim=-1)
    if top_k > 0:
        keep = torch.topk(p, top_k).indices
        q = torch.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def chi_square(samples: list[int], probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * len(samples)
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the target's candidates was sampled"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 3)])
def test_rejection_sampling_gives_the_targets_distribution(temperature, top_k):
    first, second = sample_many(20000, temperature, top_k)
    stat, df = chi_square(first, target_probs(0, temperature, top_k))
    assert stat < CHI2_999[df], (stat, df)
    # the token after an accepted first draft follows position 1's distribution
    stat, df = chi_square(second, target_probs(1, temperature, top_k))
    assert stat < CHI2_999[df], (stat, df)


def test_the_chi_square_test_fails_a_biased_acceptance_rule(monkeypatch):
    real = spec_verify._uniforms

    def biased(*args, **kwargs):  # accepts a draft with probability min(1, 2 p) instead of p
        u_accept, u_token = real(*args, **kwargs)
        return u_accept * 0.5, u_token

    monkeypatch.setattr(spec_verify, "_uniforms", biased)
    first, _ = sample_many(20000, 1.0, -1)
    stat, df = chi_square(first, target_probs(0, 1.0, -1))
    assert stat > CHI2_999[df], (stat, df)


def test_seeded_rows_draw_from_seed_and_position():
    """A seeded row without drafts draws its token from ``seeded_uniform(seed, output_len)`` like plain sampling,
    and the same seeded rows give the same answer in any batch and generator state."""
    logits = torch.stack([TARGET[0]])
    probs = torch.softmax(TARGET[0], dim=-1)
    u = seeded_uniform(11, 5)
    want = int(torch.searchsorted(probs.cumsum(0), torch.tensor([u]) * probs.sum(), right=True)[0])
    res = verify_drafts(OPS, logits, torch.tensor([0]), [1], info(1, 1.0, seeds=[11], output_lens=[5]),
                        torch.Generator().manual_seed(1))
    assert res.next_ids.tolist() == [want] and res.accept_lens.tolist() == [0]
    rows = torch.stack([TARGET[0], TARGET[1], TARGET[1]])
    ids = torch.tensor([0, DRAFT[0], DRAFT[1]])
    answers = set()
    for gen_seed in range(3):
        res = verify_drafts(OPS, rows, ids, [3], info(1, 1.0, seeds=[123], output_lens=[9]),
                            torch.Generator().manual_seed(gen_seed))
        answers.add((res.accept_lens.item(), res.next_ids.item()))
    assert len(answers) == 1


def test_usage_reports_accepted_and_rejected_predictions():
    from raymoe.deploy.generation import Piece
    from raymoe.deploy.responses import usage_dict

    plain = usage_dict(Piece("", [], finish_reason="stop", prompt_tokens=3, completion_tokens=5))
    assert "completion_tokens_details" not in plain and plain["total_tokens"] == 8
    spec = usage_dict(Piece("", [], finish_reason="stop", prompt_tokens=3, completion_tokens=5,
                            accepted_prediction_tokens=2, rejected_prediction_tokens=4))
    assert spec["completion_tokens"] == 5  # unchanged in meaning
    assert spec["completion_tokens_details"] == {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 4}


def test_a_capped_draft_is_not_tested_past_its_cap():
    """A grammar cuts a draft where it refuses a token (``caps``): drafts past the cap are never tested, so the
    row's own token there is drawn from the whole distribution (a rule that counted the untested draft as rejected
    would leave it out, and the chi-square test below would fail on token 3, the second draft)."""
    n = 20000
    logits = torch.stack([TARGET[0], TARGET[1], TARGET[1]] * n)
    ids = torch.tensor([0, DRAFT[0], DRAFT[1]] * n)
    res = verify_drafts(OPS, logits, ids, [3] * n, info(n, 1.0), torch.Generator().manual_seed(1), caps=[1] * n)
    acc, nxt = res.accept_lens.tolist(), res.next_ids.tolist()
    assert max(acc) == 1
    first = [DRAFT[0] if a >= 1 else t for a, t in zip(acc, nxt, strict=True)]
    second = [t for a, t in zip(acc, nxt, strict=True) if a == 1]
    for samples, pos in ((first, 0), (second, 1)):
        stat, df = chi_square(samples, target_probs(pos, 1.0, -1))
        assert stat < CHI2_999[df], (pos, stat, df)
    greedy = verify_drafts(OPS, one_hot_logits([1, 3, 2]), torch.tensor([0, 1, 3]), [3], info(1),
                           torch.Generator(), caps=[1])
    assert greedy.accept_lens.tolist() == [1] and greedy.next_ids.tolist() == [3]  # 3 agrees but lies past the cap
