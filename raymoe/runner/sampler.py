"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2020), min-p (Nguyen et al. 2024).

Sampling inverts each row's cumulative distribution at one uniform draw ``u``: the token is the first ``i`` with
``cdf_i > u * cdf_V`` (zero-probability tokens never win: the cdf does not rise there). One random number per row,
instead of one per vocabulary entry for a Gumbel/exponential race, which on CPU cost more than the sampling math
itself. The draw of a seeded request comes from a generator seeded by ``(seed, tokens generated so far)``, so a
seeded request gives the same tokens whatever batch it shares.

On a CPU rank with the fused kernels, a batch without top-k/top-p/min-p filters is sampled by one kernel call
(``raymoe.platform.cpu.kernels.cpu_ops.sample_rows``: the same rule at the same draws) instead of about twenty operators.

Greedy rows take :func:`greedy_argmax`: ATen's CPU ``argmax`` over a long last dim is a scalar loop (about 4 ns
per element, 5 ms for 256 x 8192 logits on one core) while ``amax`` is vectorized, so the vocabulary is reduced
in chunks with ``amax`` first and ``argmax`` then runs only over each row's winning chunk.
"""

from __future__ import annotations

import torch

from raymoe.platform.cpu.kernels import cpu_ops
from raymoe.runner.forward_batch import SamplingBatchInfo
from raymoe.step.step_output import TokenLogprobs

_SEED_MIX = 1_000_003
_ARGMAX_CHUNK = 128  # vocabulary entries per chunk of greedy_argmax


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row: the result of ``torch.argmax(logits, dim=-1)``, ties included.

    Args:
        logits: [bs, V] float (any float dtype, any device).
    Returns:
        [bs] int64 token ids.

    On CPU, with ``V`` a multiple of ``_ARGMAX_CHUNK`` and a contiguous ``logits``, rows are cut into chunks:
    ``amax`` per chunk, ``argmax`` over the chunk maxima (the first chunk holding the row maximum), then ``argmax``
    inside that chunk (its first maximum), which is the row's first maximum. Elsewhere it is plain ``argmax``.
    """
    bs, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % _ARGMAX_CHUNK or vocab == _ARGMAX_CHUNK or not logits.is_contiguous():
        return torch.argmax(logits, dim=-1)
    chunks = logits.view(bs, vocab // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best = chunks.amax(dim=-1).argmax(dim=-1)                                  # [bs] chunk index
    rows = chunks[torch.arange(bs, device=logits.device), best]                # [bs, chunk]
    return best * _ARGMAX_CHUNK + rows.argmax(dim=-1)


class Sampler:
    """Samples one token per row of ``logits``.

    Args:
        seed: seed of the generator used by unseeded rows.
        device: where the random draws are made.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
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

    def _draw(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Token ids [bs] int64 drawn from the (unnormalized) rows of ``probs`` [bs, V] by inverse CDF."""
        cdf = probs.cumsum(dim=-1)
        target = self._uniforms(probs.shape[0], info) * cdf[:, -1]
        ids = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
        return ids.clamp_(max=probs.shape[-1] - 1)

    @staticmethod
    def _needs_filter(info: SamplingBatchInfo) -> bool:
        """Whether any row restricts the candidates (top-k > 0, top-p < 1 or min-p > 0)."""
        return bool((info.top_ks > 0).any() or (info.top_ps < 1.0).any() or (info.min_ps > 0.0).any())

    @staticmethod
    def _filter(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        vocab = probs.shape[-1]
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        k = torch.where(info.top_ks > 0, info.top_ks, torch.full_like(info.top_ks, vocab))
        drop = ranks >= k[:, None]
        cum = sorted_p.cumsum(dim=-1)
        drop |= (cum - sorted_p) > info.top_ps[:, None]
        drop |= sorted_p < (info.min_ps[:, None] * sorted_p[:, :1])
        drop[:, 0] = False
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)

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
        filtered = not info.all_greedy and self._needs_filter(info)
        if info.all_greedy:
            next_ids = greedy_argmax(logits)
        elif not filtered and cpu_ops.enabled_for(logits, info.temperatures) and logits.stride(-1) == 1:
            # one fused call: greedy rows (temperature 0) take their first maximum, the others the same inverse
            # CDF at the same draws as below (cpu_ops.sample_rows)
            next_ids = cpu_ops.sample_rows(logits, info.temperatures.contiguous(),
                                           self._uniforms(logits.shape[0], info))
        else:
            greedy_ids = greedy_argmax(logits)
            greedy_rows = (info.temperatures == 0.0) | (info.top_ks == 1)
            temps = torch.where(greedy_rows, torch.ones_like(info.temperatures), info.temperatures)
            probs = torch.softmax(logits / temps[:, None], dim=-1)
            if filtered:  # sorting the vocabulary is the costliest part: only when asked
                probs = self._filter(probs, info)
            sampled = self._draw(probs, info)
            next_ids = torch.where(greedy_rows, greedy_ids, sampled)
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
