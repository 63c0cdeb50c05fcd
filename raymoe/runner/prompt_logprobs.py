"""Scoring a step's prompt positions on the rank (``prompt_logprobs``; the records: ``raymoe.step.prompt_scores``).

A step with prompt-scoring rows computes the LM head over every token of the step (one call, so the ranks of a head
split over the DP group make the same call; ``ModelRunner._launch_step``), and :func:`score_prompts` takes the
scored positions' rows of those float32 logits: the log-softmax at each, the log-probability of the prompt token
that follows and the top ``k`` (the sampler's own log-prob arithmetic, ``Sampler.logprobs_of``), copied to the
host behind the step's tokens (no host sync at launch). The targets come from the batch's host lists, so nothing
is read back from the device to build them.
"""

from __future__ import annotations

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
        copy: the host copy of ``scores.device_tensors()``.
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
        _, flat = self.scores.answer(self.copy.tensors)
        out, at = [], 0
        for r in self.rows:
            out.append(PromptLogprobs(r.row, r.first_token, tuple(flat[at:at + r.num_positions])))
            at += r.num_positions
        return tuple(out)


def score_prompts(ops, logits: torch.Tensor, batch: ModelWorkerBatch) -> PendingPromptScores:
    """Score ``batch.prompt_score_rows`` from the step's logits (module docstring).

    Args:
        ops: the rank's platform (its host copy). logits: [T, V] float32, one row per token of the step, in the
            batch's token order. batch: the step (its ``input_ids`` and ``extend_lens`` give the targets).

    Returns:
        the pending scores (their host copy started).

    Raises:
        ValueError: a scoring row does not fit its chunk (``PromptScoreRow.targets``), or ``logits`` does not have
            one row per token.
    """
    if logits.shape[0] != batch.num_tokens:
        raise ValueError(f"prompt scoring needs logits of every token: {logits.shape[0]} rows for "
                         f"{batch.num_tokens} tokens")
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
    idx = to_device(positions, torch.int64, logits.device)
    scores = Sampler.logprobs_of(logits.index_select(0, idx), to_device(targets, torch.int64, logits.device),
                                 wanted)
    return PendingPromptScores(batch.prompt_score_rows, scores, ops.copy_to_host(scores.device_tensors()))
