"""Scoring a step's prompt positions on the rank (``prompt_logprobs``; the records: ``raymoe.step.prompt_scores``).

A step with prompt-scoring rows computes the LM head once over the positions it needs: the rows' sampling
positions and the scored ones (one call, so the ranks of a head split over the DP group make the same call;
:func:`logits_and_scores`, from ``ModelRunner._launch_step``); the scored positions' float32 logits give the
log-softmax at each, the log-probability of the prompt token that follows and the top ``k`` (the sampler's own
log-prob arithmetic, ``Sampler.logprobs_of``), copied to the host behind the step's tokens (no host sync at
launch). Memory: ``P x V`` float32 logits for ``P`` scored positions in a step (chunked prefill bounds ``P``).
The targets come from the batch's host lists, so nothing is read back from the device to build them.
"""

from __future__ import annotations

import dataclasses

import torch

from raymoe.platform.interface import HostCopy
from raymoe.runner.sampler import SampledTokens, Sampler
from raymoe.step.host_transfer import to_device
from raymoe.step.prompt_scores import PromptScoreRow
from raymoe.step.step_output import PromptLogprobs
from raymoe.step.worker_batch import ModelWorkerBatch


class PendingPromptScores:
    """The prompt scores of a launched step, on their way to the host.

    Args:
        rows: the step's scoring rows. scores: one log-prob row per scored position, rows after rows.
        copy: the host copy of ``scores.device_tensors()`` and then the positions' ranks ([P] int64).
    """

    def __init__(self, rows: tuple[PromptScoreRow, ...], scores: SampledTokens, copy: HostCopy):
        self.rows = rows
        self.scores = scores
        self.copy = copy

    def ready(self) -> bool:
        """Whether :meth:`answer` would return without waiting for the device."""
        return self.copy.ready()

    def answer(self) -> tuple[PromptLogprobs, ...]:
        """Waits for the copy; one :class:`~raymoe.step.step_output.PromptLogprobs` per scoring row, in row order."""
        self.copy.wait()
        _, flat = self.scores.answer(self.copy.tensors[:-1])
        flat = [dataclasses.replace(s, rank=k) for s, k in zip(flat, self.copy.tensors[-1].tolist(), strict=True)]
        out, at = [], 0
        for r in self.rows:
            out.append(PromptLogprobs(r.row, r.first_token, tuple(flat[at:at + r.num_positions])))
            at += r.num_positions
        return tuple(out)


def _targets(batch: ModelWorkerBatch) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per scored position of ``batch``: its token index in the step, its target token and top-k; and each row's
    sampling position (its last token)."""
    starts, at = [], 0
    for e in batch.extend_lens:
        starts.append(at)
        at += e
    positions: list[int] = []
    targets: list[int] = []
    wanted: list[int] = []
    for r in batch.prompt_score_rows:
        s = starts[r.row]
        targets += r.targets(batch.input_ids[s:s + batch.extend_lens[r.row]])
        positions += range(s, s + r.num_positions)
        wanted += [r.top_k] * r.num_positions
    samples = [s + e - 1 for s, e in zip(starts, batch.extend_lens, strict=True)]
    return positions, targets, wanted, samples


def logits_and_scores(model, ops, hidden: torch.Tensor, batch: ModelWorkerBatch, rows_per_rank: int | None,
                      all_tokens: bool) -> tuple[torch.Tensor, PendingPromptScores]:
    """The step's logits and its prompt scores (module docstring), from one LM-head call over the rows they need:
    every token with ``all_tokens`` (a verify step), else the union of the rows' sampling positions and the scored
    positions (a distinct subset of the step's tokens, so a shared row bound still holds), never the tokens of
    other prefill rows.

    Args:
        model: the rank's model (``compute_logits``). ops: the rank's platform. hidden: [T, H] the final hidden
            states. batch: the step. rows_per_rank: the LM head's shared row bound (``dispatch_capacity``).
        all_tokens: return logits of every token.
    Returns:
        (logits [T, V] with ``all_tokens``, else [bs, V] one per row's sampling position; float32), the scores.
    Raises:
        ValueError: a scoring row does not fit its chunk (``PromptScoreRow.targets``).
    """
    positions, targets, wanted, samples = _targets(batch)
    dev = hidden.device
    if all_tokens:
        logits = model.compute_logits(hidden, rows_per_rank)
        scored = logits.index_select(0, to_device(positions, torch.int64, dev))
    else:
        union = sorted(set(samples) | set(positions))
        at = {p: k for k, p in enumerate(union)}
        rows = model.compute_logits(hidden.index_select(0, to_device(union, torch.int64, dev)), rows_per_rank)
        logits = rows.index_select(0, to_device([at[p] for p in samples], torch.int64, dev))
        scored = rows.index_select(0, to_device([at[p] for p in positions], torch.int64, dev))
    ids = to_device(targets, torch.int64, dev)
    scores = Sampler.logprobs_of(scored, ids, wanted)
    ranks = (scored > scored.gather(1, ids[:, None])).sum(dim=1) + 1  # 1 + the tokens more likely than the prompt's
    return logits, PendingPromptScores(batch.prompt_score_rows, scores,
                                       ops.copy_to_host([*scores.device_tensors(), ranks]))
