"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2020), min-p (Nguyen et al. 2024).

Sampling uses the exponential race (Gumbel-max in another form): ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``
draws token i with probability ``p_i``. The noise of a seeded request comes from a generator seeded by
``(seed, tokens generated so far)``, so a seeded request gives the same tokens whatever batch it shares.

Greedy rows take :func:`greedy_argmax`: ATen's CPU ``argmax`` over a long last dim is a scalar loop (about 4 ns
per element, 5 ms for 256 x 8192 logits on one core) while ``amax`` is vectorized, so the vocabulary is reduced
in chunks with ``amax`` first and ``argmax`` then runs only over each row's winning chunk.
"""

from __future__ import annotations

import torch

from raymoe.runner.forward_batch import SamplingBatchInfo
from raymoe.scheduler.model_worker_batch import TokenLogprobs

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
        device: where the noise is drawn.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def _noise(self, bs: int, vocab: int, info: SamplingBatchInfo) -> torch.Tensor:
        noise = torch.empty((bs, vocab), dtype=torch.float32, device=self.device)
        noise.exponential_(generator=self.generator)
        for i, seed in enumerate(info.seeds):
            if seed is not None:
                mixed = (seed * _SEED_MIX + info.output_lens[i]) % 2**63
                g = torch.Generator(device=self.device).manual_seed(mixed)
                noise[i].exponential_(generator=g)
        return noise

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
        greedy_ids = greedy_argmax(logits)
        if info.all_greedy:
            next_ids = greedy_ids
        else:
            greedy_rows = (info.temperatures == 0.0) | (info.top_ks == 1)
            temps = torch.where(greedy_rows, torch.ones_like(info.temperatures), info.temperatures)
            probs = torch.softmax(logits / temps[:, None], dim=-1)
            probs = self._filter(probs, info)
            sampled = torch.argmax(probs / self._noise(*logits.shape, info), dim=-1)
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
