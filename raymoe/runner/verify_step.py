"""The tail of a verify step on the rank (speculative decoding): after the target scored every draft token, the
rows' penalties (rows without drafts) and grammar masks (every draft position), the acceptance
(``raymoe.runner.spec_verify``), the rows' new states (penalty counts, grammar matchers, hybrid models' recurrent
states at the last accepted token, the future-token map) and the draft model's passes for the next step.

Ownership: ``ModelRunner._launch_step`` calls :func:`finish_verify_step` for a TARGET_VERIFY step, or a MIXED step
whose decode rows verify drafts; it reads the runner's parts and returns the step's ``PendingStep``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from raymoe.runner.prompt_logprobs import PendingPromptScores
from raymoe.runner.sampler import SampledTokens
from raymoe.runner.spec_verify import draft_windows, verify_rows
from raymoe.runner.step_result import PendingStep
from raymoe.step.worker_batch import ModelWorkerBatch

if TYPE_CHECKING:
    from raymoe.runner.forward_batch import ForwardBatch
    from raymoe.runner.model_runner import ModelRunner


def finish_verify_step(runner: ModelRunner, batch: ModelWorkerBatch, fb: ForwardBatch, logits: torch.Tensor,
                       hidden: torch.Tensor | None, drafting: bool, t0: float, load,
                       prompt: PendingPromptScores | None) -> PendingStep:
    """Accept drafts and sample one more token per row (module docstring); no host sync.

    Args:
        runner: the rank's runner. batch, fb: the step. logits: [T, V] float32, one row per token.
        hidden: [T, H] the target's final hidden states (the draft model reads them), or None without one.
        drafting: the draft model's passes run after this step (the driver's decision). t0: the step's start
            (``time.perf_counter()``). load: the expert-load copy, or None. prompt: the step's prompt scores.
    Returns:
        the step's pending answer: the ids and then the accepted counts on their way to the host.
    """
    drafts_per_row = list(batch.draft_lens) or [e - 1 for e in fb.extend_lens_cpu]
    drafted = None
    penalized = runner.penalties.rows_of(batch.req_pool_indices)
    firsts = draft_windows(fb.extend_lens_cpu, drafts_per_row) if penalized or batch.grammar_rows else None
    if penalized:  # rows without drafts (SpecSteps.step_drafts): their own token, at their last position
        logits = runner.penalties.apply(logits, batch.req_pool_indices, penalized,
                                        [firsts[i] for i in penalized], batch.seq_lens)
    if batch.grammar_rows:  # constrained rows: masked at every draft position (raymoe.runner.grammar)
        windows = [(f, list(batch.input_ids[f + 1:f + 1 + k]))
                   for f, k in zip(firsts, drafts_per_row, strict=True)]
        logits, drafted = runner.grammars.mask_drafts(batch.grammar_rows, batch.req_pool_indices, logits,
                                                      windows)
    res = verify_rows(runner.ops, logits, fb.input_ids, fb.extend_lens_cpu, drafts_per_row, fb.sampling,
                      runner.sampler.generator, None if drafted is None else drafted.caps)
    grammar = None if drafted is None else runner.grammars.accept_verified(drafted, res.accept_lens,
                                                                           res.next_ids)
    if penalized:
        runner.penalties.record(res.next_ids, batch.req_pool_indices, penalized, batch.seq_lens)
    commit = getattr(runner.model, "commit_verify_states", None)
    if commit is not None:  # hybrid models: linear-attention states at each row's last accepted token
        commit(fb.req_pool_indices, res.accept_lens)
    runner.future_tokens.store(res.next_ids)
    drafts = ()
    if drafting:
        drafts = runner.drafter.draft(batch, fb.input_ids, hidden, res.next_ids.tolist(),
                                      res.accept_lens.tolist())
    return PendingStep(SampledTokens(res.next_ids, [None] * fb.batch_size),
                       runner.ops.copy_to_host([res.next_ids, res.accept_lens]), t0, load, grammar,
                       verify=True, drafts=drafts, prompt=prompt)
