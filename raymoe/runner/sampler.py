"""Token sampling: greedy, temperature, top-k, top-p (Holtzman et al. 2020), min-p (Nguyen et al. 2024).

The sampler draws one uniform number per row and hands the arithmetic to the rank's platform (``Platform.
greedy_argmax``, ``sample_rows``, ``sample_filtered``: inverse-CDF draws, one fused kernel on a CPU rank).

No host sync: every choice the sampler makes (greedy only, filters or not, which rows are seeded, how many
log-probs) comes from host lists of the step's ``SamplingBatchInfo``, and it answers device tensors
(:class:`SampledTokens`); the runner copies them to the host without blocking (``Platform.copy_to_host``).

Seeded rows: the draw of a row whose request has a seed is a pure function of ``(seed, tokens generated so far)``
(:func:`seeded_uniform`, SplitMix64 on the host), so a seeded request gives the same tokens whatever batch it
shares, on any device, and no per-row generator is built (a CUDA generator per seeded row and step cost a
generator construction and a seeding each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.platform.interface import Platform
from raymoe.runner.forward_batch import SamplingBatchInfo
from raymoe.step.host_transfer import to_device
from raymoe.step.step_output import TokenLogprobs

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One SplitMix64 output for state ``x`` (Steele, Lea, Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014; the constants of Vigna's ``splitmix64.c``), as a Python int in [0, 2**64)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, output_len: int) -> float:
    """The draw in [0, 1) of a seeded row: SplitMix64 of the seed, mixed with the number of tokens the request has
    generated, keeping the top 24 bits (exact in float32). Integer arithmetic on the host: the same value on
    every device and in every batch.

    Args:
        seed: the request's seed (any int; taken modulo 2**64). output_len: tokens generated so far (>= 0).
    """
    return (splitmix64(splitmix64(seed & _MASK64) ^ output_len) >> 40) / float(1 << 24)


@dataclass(frozen=True)
class SampledTokens:
    """One step's sampled ids and log-probs, still on the rank's device.

    Attributes:
        next_ids: [bs] int64 sampled token ids.
        wanted: per row, how many top log-probs its request asked for (None: no log-probs), host list of ``bs``.
        chosen: [bs] float32 log-prob of each sampled token (None when no row asked).
        top_ids: [bs, k] int64 and top_values: [bs, k] float32, the ``k = max(wanted)`` most likely tokens of
            each row (None when no row asked for any).
    """

    next_ids: torch.Tensor
    wanted: list[int | None]
    chosen: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None

    def device_tensors(self) -> list[torch.Tensor]:
        """What must reach the host: ``next_ids``, then the log-prob tensors that exist, in field order."""
        return [t for t in (self.next_ids, self.chosen, self.top_ids, self.top_values) if t is not None]

    def answer(self, host: list[torch.Tensor]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The host answer from host copies of :meth:`device_tensors` (same order): the ids and one entry per
        row, ``None`` where its request asked for no log-probs."""
        ids = host[0].tolist()
        if self.chosen is None:
            return ids, [None] * len(ids)
        chosen = host[1].tolist()
        top_ids = host[2].tolist() if self.top_ids is not None else None
        top_values = host[3].tolist() if self.top_values is not None else None
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(self.wanted):
            if n is None:
                out.append(None)
            else:
                out.append(TokenLogprobs(chosen[i], top_ids[i][:n] if n else [], top_values[i][:n] if n else []))
        return ids, out


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
        """One draw in [0, 1) per row, [bs] float32: the rank's generator, and :func:`seeded_uniform` for seeded
        rows (written in place by index; their values and rows are host numbers)."""
        u = torch.rand(bs, generator=self.generator, device=self.device)
        rows = [i for i, seed in enumerate(info.seeds) if seed is not None]
        if rows:
            draws = [seeded_uniform(info.seeds[i], info.output_lens[i]) for i in rows]
            u.index_copy_(0, to_device(rows, torch.int64, self.device), to_device(draws, torch.float32, self.device))
        return u

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo,
               logprob_logits: torch.Tensor | None = None) -> SampledTokens:
        """Sample, without reading anything back from the device.

        Args:
            logits: [bs, V] (any float dtype; computed in float32).
            info: per-row parameters.
            logprob_logits: [bs, V] the logits the log-probs are taken from, when they differ from the ones sampled
                (a grammar-constrained step samples masked logits and answers the model's own log-probs, as vLLM
                does by default: no ``-inf`` alternatives); None: ``logits``.
        Returns:
            the ids and requested log-probs of the model distribution, on the logits' device.
        """
        logits = logits.float()
        if info.all_greedy:
            next_ids = self.ops.greedy_argmax(logits)
        elif info.needs_filter:  # sorting the vocabulary is the costliest part: only when asked
            next_ids = self.ops.sample_filtered(logits, info.temperatures, info.top_ks, info.top_ps, info.min_ps,
                                                self._uniforms(logits.shape[0], info))
        else:
            next_ids = self.ops.sample_rows(logits, info.temperatures, self._uniforms(logits.shape[0], info))
        return self.logprobs_of(logits if logprob_logits is None else logprob_logits.float(), next_ids,
                                info.logprobs)

    def __call__(self, logits: torch.Tensor,
                 info: SamplingBatchInfo) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """:meth:`sample`, with the log-probs brought to the host (a blocking copy: for callers outside a step).

        Returns:
            (token ids [bs] int64 on the logits' device, per-row log-probs or None).
        """
        sampled = self.sample(logits, info)
        _, logprobs = sampled.answer([t.cpu() for t in sampled.device_tensors()])
        return sampled.next_ids, logprobs

    @staticmethod
    def logprobs_of(logits: torch.Tensor, next_ids: torch.Tensor, wanted: list[int | None]) -> SampledTokens:
        """``next_ids`` with the log-probs each row asked for (None: none; ``k``: the token's own and the top
        ``k``), on the logits' device.

        Args:
            logits: [N, V] float32. next_ids: [N] int64, the token of each row. wanted: N entries.
        """
        if all(n is None for n in wanted):
            return SampledTokens(next_ids, list(wanted))
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(1, next_ids[:, None])[:, 0]
        k = max(n or 0 for n in wanted)
        if not k:
            return SampledTokens(next_ids, list(wanted), chosen)
        top_values, top_ids = torch.topk(logp, k, dim=-1)
        return SampledTokens(next_ids, list(wanted), chosen, top_ids, top_values)
