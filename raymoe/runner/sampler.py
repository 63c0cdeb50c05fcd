"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2020), min-p (Nguyen et al. 2024).

The sampler draws one uniform number per row and hands the arithmetic to the rank's platform (``Platform.
greedy_argmax``, ``sample_rows``, ``sample_filtered``: inverse-CDF draws, one fused kernel on a CPU rank). The draw of
a seeded request comes from a generator seeded by ``(seed, tokens generated so far)``, so a seeded request gives the
same tokens whatever batch it shares.
"""

from __future__ import annotations

import torch

from raymoe.platform.interface import Platform
from raymoe.runner.forward_batch import SamplingBatchInfo
from raymoe.step.step_output import TokenLogprobs

_SEED_MIX = 1_000_003


class Sampler:
    """Samples one token per row of ``logits``.

    Args:
        ops: the rank's platform.
        seed: seed of the generator used by unseeded rows.
        device: where the random draws are made.
    """

    def __init__(self, ops: Platform, seed: int = 0, device: torch.device | str = "cpu"):
        self.ops = ops
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def _uniforms(self, bs: int, info: SamplingBatchInfo) -> torch.Tensor:
        """One draw in [0, 1) per row, [bs] float32 (seeded rows from their own generator)."""
        u = torch.rand(bs, generator=self.generator, device=self.device)
        for i, seed in enumerate(info.seeds):
            if seed is not None:
                mixed = (seed * _SEED_MIX + info.output_lens[i]) % 2**63
                g = torch.Generator(device=self.device).manual_seed(mixed)
                u[i] = torch.rand(1, generator=g, device=self.device)[0]
        return u

    @staticmethod
    def _needs_filter(info: SamplingBatchInfo) -> bool:
        """Whether any row restricts the candidates (top-k > 0, top-p < 1 or min-p > 0)."""
        return bool((info.top_ks > 0).any() or (info.top_ps < 1.0).any() or (info.min_ps > 0.0).any())

    def __call__(self, logits: torch.Tensor,
                 info: SamplingBatchInfo) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """Sample.

        Args:
            logits: [bs, V] (any float dtype; computed in float32).
            info: per-row parameters.
        Returns:
            (token ids [bs] int64, per-row log-probs of the model distribution or None).
        """
        logits = logits.float()
        if info.all_greedy:
            next_ids = self.ops.greedy_argmax(logits)
        elif self._needs_filter(info):  # sorting the vocabulary is the costliest part: only when asked
            next_ids = self.ops.sample_filtered(logits, info.temperatures, info.top_ks, info.top_ps, info.min_ps,
                                                self._uniforms(logits.shape[0], info))
        else:
            next_ids = self.ops.sample_rows(logits, info.temperatures, self._uniforms(logits.shape[0], info))
        return next_ids, self._logprobs(logits, next_ids, info)

    @staticmethod
    def _logprobs(logits: torch.Tensor, next_ids: torch.Tensor, info: SamplingBatchInfo) -> list[TokenLogprobs | None]:
        if all(n is None for n in info.logprobs):
            return [None] * logits.shape[0]
        logp = torch.log_softmax(logits, dim=-1)
        k = max(n or 0 for n in info.logprobs)
        top_v, top_i = torch.topk(logp, k, dim=-1) if k else (None, None)
        chosen = logp.gather(1, next_ids[:, None])[:, 0].tolist()
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(info.logprobs):
            if n is None:
                out.append(None)
            else:
                ids = top_i[i, :n].tolist() if n else []
                vals = top_v[i, :n].tolist() if n else []
                out.append(TokenLogprobs(chosen[i], ids, vals))
        return out
