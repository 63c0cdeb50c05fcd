"""Accepting draft tokens on the rank: greedy by exact match, sampled rows by rejection sampling.

A ``ForwardMode.TARGET_VERIFY`` row of request ``i`` computes ``e_i = 1 + k_i`` tokens: its newest token ``x_0``
and ``k_i`` draft tokens ``d_1 .. d_k`` (``input_ids``), with the target's logits at each of them. Position ``j``'s
logits give the target's distribution ``p_j`` of the token after ``x_0, d_1 .. d_j``. The row's answer is the
number ``a_i`` of drafts accepted and one more token of the target's own, ``t_i``: the request gains
``d_1 .. d_a, t``.

* Greedy rows (temperature 0 or top-k 1): ``d_{j+1}`` is accepted while it equals ``argmax p_j``; ``t`` is
  ``argmax p_a``. The tokens equal those of plain decoding, one per step.
* Sampled rows: speculative sampling (Leviathan, Kalman, Matias, "Fast Inference from Transformers via
  Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model Decoding with Speculative
  Sampling", 2023). The drafts here are deterministic (a point mass ``q = delta(d)``), so ``d_{j+1}`` is accepted
  with probability ``min(1, p_j(d) / q(d)) = p_j(d)``; at the first rejection ``t`` is drawn from the residual
  ``max(p_j - q, 0)``, i.e. ``p_j`` without ``d``, renormalized; if every draft is accepted ``t`` is drawn from
  ``p_k``. Each emitted token is then distributed exactly as the target's (``p`` is the distribution the plain
  sampler draws from: temperature, top-k, top-p and min-p applied, ``Platform.sampling_probs``).

Seeded rows draw from ``(seed, position)`` as plain sampling does (``raymoe.runner.sampler.seeded_uniform``): the
acceptance test of draft ``j`` at output position ``n + j`` and the draw of ``t`` at ``n + a``, with the
acceptance draws from a second stream of the seed, so a seeded request gives the same tokens in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.platform.interface import Platform
from raymoe.runner.forward_batch import SamplingBatchInfo
from raymoe.runner.sampler import seeded_uniform
from raymoe.step.host_transfer import to_device

ACCEPT_STREAM = 0x5DEECE66D
"""Mixed into a seeded row's seed for its acceptance draws (a stream apart from its token draws)."""


@dataclass(frozen=True)
class VerifyResult:
    """One verify step's answer, still on the rank's device.

    Attributes:
        next_ids: [bs] int64, each row's own token ``t`` (after its accepted drafts).
        accept_lens: [bs] int64, drafts accepted per row (``0 .. k_i``).
    """

    next_ids: torch.Tensor
    accept_lens: torch.Tensor


def verify_drafts(ops: Platform, logits: torch.Tensor, input_ids: torch.Tensor, extend_lens: list[int],
                  info: SamplingBatchInfo, generator: torch.Generator,
                  caps: list[int] | None = None) -> VerifyResult:
    """Accept each row's drafts against the target's ``logits`` (module docstring).

    Args:
        ops: the rank's platform (greedy argmax, sampling distributions, draws).
        logits: [T, V] float32, the target's logits at every token of the step (``T = sum(extend_lens)``).
        input_ids: [T] int64, each row's newest token followed by its drafts.
        extend_lens: ``bs`` host counts ``1 + k_i``.
        info: the rows' sampling parameters ([bs] tensors; ``output_lens`` counts the row's tokens through its
            last draft, as ``SamplingTable.resolve`` derives it from ``seq_lens``).
        (``extend_lens`` here are the rows' ``1 + drafts``: :func:`verify_rows` cuts a batch's rows to those.)
        generator: the rank's generator, for unseeded rows.
        caps: ``bs`` most drafts each row may accept (None: all of them): a grammar-constrained row's drafts past
            the first its grammar refuses (``RankGrammars.mask_drafts``) are not tested; its own token is then
            drawn from the distribution at its cap, as for a draft of that length.
    Raises:
        ValueError: ``logits`` or ``input_ids`` do not have ``sum(extend_lens)`` rows, or a row has no token.
    """
    num_tokens, bs = sum(extend_lens), len(extend_lens)
    if logits.shape[0] != num_tokens or input_ids.shape[0] != num_tokens or min(extend_lens, default=1) < 1:
        raise ValueError(f"verify: {logits.shape[0]} logits rows and {input_ids.shape[0]} tokens for extend lengths "
                         f"summing to {num_tokens} (each >= 1)")
    device = logits.device
    starts, pos, grid = [], 0, []
    kmax = max(extend_lens)
    limits = [e - 1 for e in extend_lens] if caps is None else [min(e - 1, c) for e, c in
                                                                 zip(extend_lens, caps, strict=True)]
    for e, lim in zip(extend_lens, limits, strict=True):  # [bs, kmax] each row's tested draft positions; T beyond
        starts.append(pos)
        grid.append([pos + j if j < lim else num_tokens for j in range(kmax)])
        pos += e
    start_t = to_device(starts, torch.int64, device)
    grid_t = to_device(grid, torch.int64, device)
    following = torch.cat([input_ids[1:], input_ids[:1]])  # [T] the token after each position (a draft where it is one)
    greedy_ids = ops.greedy_argmax(logits)
    if info.all_greedy:
        agree = torch.cat([greedy_ids == following, torch.zeros(1, dtype=torch.bool, device=device)])
        accept = agree[grid_t].to(torch.int64).cumprod(dim=1).sum(dim=1)
        return VerifyResult(greedy_ids[start_t + accept], accept)

    lens_t = to_device(extend_lens, torch.int64, device)
    per_token = {name: torch.repeat_interleave(getattr(info, name), lens_t)
                 for name in ("temperatures", "top_ks", "top_ps", "min_ps")}
    greedy_rows = (info.temperatures == 0.0) | (info.top_ks == 1)
    probs = ops.sampling_probs(logits.float(), per_token["temperatures"], per_token["top_ks"], per_token["top_ps"],
                               per_token["min_ps"])
    probs = probs / probs.sum(dim=1, keepdim=True)  # the filters leave the candidates' mass unnormalized
    p_draft = probs.gather(1, following[:, None])[:, 0]  # [T] target probability of the next draft
    u_accept, u_token = _uniforms(extend_lens, info, generator, device)
    greedy_t = torch.repeat_interleave(greedy_rows, lens_t)
    agree = torch.where(greedy_t, greedy_ids == following, u_accept < p_draft)
    agree = torch.cat([agree, torch.zeros(1, dtype=torch.bool, device=device)])
    accept = agree[grid_t].to(torch.int64).cumprod(dim=1).sum(dim=1)
    final = start_t + accept  # [bs] the position whose distribution gives the row's own token
    dist = probs[final]
    rejected = accept < to_device(limits, torch.int64, device)  # the draft after ``final`` was tested and
    # rejected: draw from p without it
    dist = dist.scatter(1, following[final][:, None], torch.where(rejected[:, None], 0.0, dist.gather(
        1, following[final][:, None])))
    dist = torch.where(dist.sum(dim=1, keepdim=True) > 0, dist, probs[final])  # (p put all its mass on the draft)
    drawn = ops.sample_rows(torch.log(dist), torch.ones(bs, device=device), u_token[final])
    return VerifyResult(torch.where(greedy_rows, greedy_ids[final], drawn), accept)


def draft_windows(extend_lens: list[int], draft_lens: list[int]) -> list[int]:
    """Each row's first verified position (its newest token) in a step's token order: rows hold ``extend_lens``
    tokens, the last ``1 + draft_lens[i]`` of them verified."""
    firsts, pos = [], 0
    for e, k in zip(extend_lens, draft_lens, strict=True):
        firsts.append(pos + e - 1 - k)
        pos += e
    return firsts


def verify_rows(ops: Platform, logits: torch.Tensor, input_ids: torch.Tensor, extend_lens: list[int],
                draft_lens: list[int], info: SamplingBatchInfo, generator: torch.Generator,
                caps: list[int] | None = None) -> VerifyResult:
    """:func:`verify_drafts` over the last ``1 + draft_lens[i]`` positions of each row of a batch whose rows may
    also hold other tokens (a MIXED batch: prefill rows with no draft sample their last position; decode rows
    verify their drafts). ``logits`` [T, V] at every token; ``extend_lens``, ``draft_lens``, ``caps``: ``bs`` host
    counts (``caps``: :func:`verify_drafts`)."""
    window = [f + j for f, k in zip(draft_windows(extend_lens, draft_lens), draft_lens, strict=True)
              for j in range(k + 1)]
    idx = to_device(window, torch.int64, logits.device)
    return verify_drafts(ops, logits[idx], input_ids[idx], [1 + k for k in draft_lens], info, generator, caps)


def _uniforms(extend_lens: list[int], info: SamplingBatchInfo, generator: torch.Generator,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two draws in [0, 1) per token, [T] float32 each: the acceptance test of the draft after it and the draw of
    a token there. Seeded rows: ``seeded_uniform`` at the token's output position (module docstring)."""
    num_tokens = sum(extend_lens)
    u_accept = torch.rand(num_tokens, generator=generator, device=device)
    u_token = torch.rand(num_tokens, generator=generator, device=device)
    rows, acc, tok = [], [], []
    pos = 0
    for i, e in enumerate(extend_lens):
        seed = info.seeds[i]
        if seed is not None:
            base = info.output_lens[i] - (e - 1)  # tokens generated before this step's own token
            for j in range(e):
                rows.append(pos + j)
                acc.append(seeded_uniform(seed ^ ACCEPT_STREAM, base + j))
                tok.append(seeded_uniform(seed, base + j))
        pos += e
    if rows:
        idx = to_device(rows, torch.int64, device)
        u_accept.index_copy_(0, idx, to_device(acc, torch.float32, device))
        u_token.index_copy_(0, idx, to_device(tok, torch.float32, device))
    return u_accept, u_token
