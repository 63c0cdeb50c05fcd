"""Reference sampling in torch operators: greedy argmax and inverse-CDF draws, with optional top-k, top-p (Holtzman
et al. 2020) and min-p (Nguyen et al. 2024) filters. The methods of :class:`SamplingOps` implement the sampling
part of :class:`~raymoe.platform.interface.Platform`.

A draw inverts each row's cumulative distribution at one uniform number ``u``: the token is the first ``i`` with
``cdf_i > u * cdf_V`` (zero-probability tokens never win: the cdf does not rise there). One random number per row,
instead of one per vocabulary entry for a Gumbel race.
"""

from __future__ import annotations

import torch


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids [bs] int64 drawn from the unnormalized rows of ``probs`` [bs, V] at ``uniforms`` [bs] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms * cdf[:, -1]
    ids = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return ids.clamp_(max=probs.shape[-1] - 1)


def filter_candidates(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                      min_ps: torch.Tensor) -> torch.Tensor:
    """``probs`` [bs, V] with every token outside a row's candidates set to 0: beyond its ``top_ks`` most probable
    (0: no limit), past the smallest prefix whose mass reaches ``top_ps``, or below ``min_ps`` times its most
    probable token's; the most probable token always stays. ``top_ks`` int64, ``top_ps``, ``min_ps`` float32 [bs].
    Sorts the vocabulary: the costliest part of sampling, so callers filter only when a row asks."""
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.where(top_ks > 0, top_ks, torch.full_like(top_ks, vocab))
    drop = ranks >= k[:, None]
    cum = sorted_p.cumsum(dim=-1)
    drop |= (cum - sorted_p) > top_ps[:, None]
    drop |= sorted_p < (min_ps[:, None] * sorted_p[:, :1])
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


class SamplingOps:
    """Torch implementations of the platform's sampling operations."""

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.argmax(logits, dim=-1)

    def sample_rows(self, logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        greedy_rows = temperatures == 0.0
        temps = torch.where(greedy_rows, torch.ones_like(temperatures), temperatures)
        sampled = inverse_cdf(torch.softmax(logits / temps[:, None], dim=-1), uniforms)
        return torch.where(greedy_rows, self.greedy_argmax(logits), sampled)

    def sample_filtered(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                        top_ps: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        greedy_rows = (temperatures == 0.0) | (top_ks == 1)
        probs = self.sampling_probs(logits, temperatures, top_ks, top_ps, min_ps)
        return torch.where(greedy_rows, self.greedy_argmax(logits), inverse_cdf(probs, uniforms))

    def apply_penalties(self, x: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None, rows: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> None:
        c = counts.index_select(0, rows)
        hit = c > 0
        if seen is not None:
            hit |= seen.index_select(0, rows)
        rep = repetition[:, None]  # rows at 1 keep their logits (x / 1 and x * 1)
        y = torch.where(hit, torch.where(x > 0, x / rep, x * rep), x)
        x.copy_(y - frequency[:, None] * c - presence[:, None] * (c > 0))

    def sampling_probs(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                       top_ps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
        greedy_rows = (temperatures == 0.0) | (top_ks == 1)
        temps = torch.where(greedy_rows, torch.ones_like(temperatures), temperatures)
        return filter_candidates(torch.softmax(logits / temps[:, None], dim=-1), top_ks, top_ps, min_ps)
