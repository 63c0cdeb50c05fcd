"""Penalties and logit bias on the rank: OpenAI's ``presence_penalty`` / ``frequency_penalty``, HF's
``repetition_penalty`` and ``logit_bias``, applied to the logits a request samples from.

For a row with output token counts ``c`` [V] (and, with a repetition penalty, ``seen`` [V]: tokens of the prompt or
the output), in vLLM's order:

1. ``logit_bias``: ``l[t] += bias[t]`` (OpenAI);
2. ``repetition_penalty`` ``r`` where ``seen``: ``l / r`` if ``l > 0`` else ``l * r`` (HF transformers'
   ``RepetitionPenaltyLogitsProcessor``, from Keskar et al. 2019, "CTRL");
3. ``l -= frequency_penalty * c + presence_penalty * (c > 0)`` (OpenAI's formula);
4. ``min_tokens`` (vLLM's): while the step samples one of the request's first ``min_tokens`` output tokens
   (``seq_len < prompt_len + min_tokens``), its stop ids are set to ``-inf``.

The bias is a scatter of the rows' entries; 2 and 3 are the platform's arithmetic (``Platform.apply_penalties``:
torch operators, one C pass per row on CPU ranks). A step's index tensors are kept while its penalized rows and
their positions repeat (steady decode), and rebuilt after any admission.

State: one float32 count row per ReqToTokenPool row, ``[max_req_rows, V]`` (4 bytes x vocabulary per row, plus one
byte per entry with a repetition penalty), allocated on the first request that needs it. A request's row is set
from its :class:`~raymoe.step.logit_penalties.LogitPenalties` on each admission (the output so far, the prompt for
a repetition penalty), then every token the rank samples for it is counted on the device right after sampling:
no host sync, and with overlap scheduling the next step already sees it. A row counts the token of a step whose
sequence reaches the request's next output position (``seq_len >= prompt_len + output so far``): a prefill chunk
that does not reach its end samples a token the scheduler drops, and it is not counted. A row admitted without
penalties drops the state a previous request left there.

Rows of a step where these apply never verify drafts (``SpecSteps.step_drafts``): in a verify step a row has its own
token only (no drafts), at its last position. Log-probs stay the model's (the caller keeps the raw logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raymoe.step.host_transfer import to_device
from raymoe.step.logit_penalties import LogitPenalties
from raymoe.step.sampling_inputs import SamplingRow


@dataclass
class _StepPlan:
    """What :meth:`RankPenalties.apply` builds for one set of rows and positions, kept while it repeats."""

    key: tuple
    idx: torch.Tensor  # [n] int64 positions in the logits
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token id, value) of every bias entry
    counted: torch.Tensor | None = None  # [m] int64 rows (of the n) with penalties, None: all of them
    pool_rows: torch.Tensor | None = None  # [m] int64 their ReqToTokenPool rows; None: no penalties
    numbers: tuple = ()  # presence, frequency, repetition, [m] float32 each
    use_seen: bool = False
    stops: tuple[torch.Tensor, ...] | None = None  # (row, token id, -inf) of every stop id masked (min_tokens)


@dataclass
class _Row:
    p: LogitPenalties
    next_len: int  # prompt_len + tokens generated so far: the seq_len of the step that samples the next output
    bias_ids: torch.Tensor | None  # [n] int64
    bias_values: torch.Tensor | None  # [n] float32
    until: int = 0  # min_tokens: the first seq_len whose sampled token may stop (prompt_len + min_tokens)
    stop_ids: torch.Tensor | None = None  # [s] int64 masked before then


class RankPenalties:
    """A rank's penalty state (module docstring).

    Args:
        rows: ReqToTokenPool rows. vocab: the model's vocabulary (columns of the logits that are processed).
        device: the rank's. ops: the rank's platform (``Platform.apply_penalties``: one C pass per row on CPU).
    """

    def __init__(self, rows: int, vocab: int, device: torch.device, ops):
        self.rows, self.vocab, self.device, self.ops = rows, vocab, device, ops
        self._state: dict[int, _Row] = {}
        self._counts: torch.Tensor | None = None  # [rows, V] float32 output token counts
        self._seen: torch.Tensor | None = None  # [rows, V] bool prompt tokens (repetition penalty)
        self._plan: _StepPlan | None = None  # the last step's (apply)

    def admit(self, sampling_rows, pool: list[int]) -> None:
        """Take a step's admissions: ``sampling_rows`` ``(batch row, SamplingRow)`` pairs, ``pool`` the step's
        ReqToTokenPool rows."""
        for i, row in sampling_rows:
            self._admit(pool[i], row)
        if sampling_rows:
            self._plan = None

    def _admit(self, r: int, row: SamplingRow) -> None:
        p = row.penalties
        if p is None:
            self._state.pop(r, None)
            return
        ids = values = None
        if p.bias:
            ids = to_device([t for t, _ in p.bias], torch.int64, self.device)
            values = to_device([v for _, v in p.bias], torch.float32, self.device)
        self._state[r] = _Row(p, row.prompt_len + len(p.output_ids), ids, values)
        if p.min_tokens and p.stop_ids:
            self._state[r].until = row.prompt_len + p.min_tokens
            self._state[r].stop_ids = to_device(list(p.stop_ids), torch.int64, self.device)
        if not p.counts_tokens:
            return
        if self._counts is None:
            self._counts = torch.zeros((self.rows, self.vocab), dtype=torch.float32, device=self.device)
        self._counts[r].zero_()
        if p.output_ids:
            out = to_device(list(p.output_ids), torch.int64, self.device)
            self._counts[r].index_add_(0, out, torch.ones(len(p.output_ids), device=self.device))
        if p.repetition != 1.0:
            if self._seen is None:  # allocated with the first repetition penalty; each such row sets its marks
                self._seen = torch.zeros((self.rows, self.vocab), dtype=torch.bool, device=self.device)
            self._seen[r].zero_()
            if p.prompt_ids:
                self._seen[r, to_device(list(p.prompt_ids), torch.int64, self.device)] = True

    def rows_of(self, pool: list[int]) -> list[int]:
        """The batch rows of ``pool`` (a step's ReqToTokenPool rows) that have penalties or a bias."""
        state = self._state
        if not state:
            return []
        return [i for i, r in enumerate(pool) if r in state]

    def apply(self, logits: torch.Tensor, pool: list[int], rows: list[int], positions: list[int],
              seq_lens: list[int]) -> torch.Tensor:
        """Logits with the penalties of batch rows ``rows`` applied at ``positions`` (their rows of ``logits``).

        Args:
            logits: [N, >= V] float32 (one row per sampled position, or per token in a verify step).
            pool: the step's ReqToTokenPool rows. rows: :meth:`rows_of`. positions: ``len(rows)`` rows of ``logits``.
            seq_lens: the step's, per batch row (which rows still mask their stop ids for ``min_tokens``).
        Returns:
            a new [N, ...] tensor (``logits`` itself is not written: it may be a graph's output buffer).
        """
        state = self._state
        masked = tuple(j for j, i in enumerate(rows) if seq_lens[i] < state[pool[i]].until)
        key = (tuple(pool[i] for i in rows), tuple(positions), masked)
        plan = self._plan if self._plan is not None and self._plan.key == key else self._make_plan(key, logits.device)
        self._plan = plan  # steady decode: the same rows step after step
        sub = logits.index_select(0, plan.idx)
        part = sub[:, :self.vocab]
        if plan.bias is not None:
            at, ids, values = plan.bias
            part.index_put_((at, ids), values, accumulate=True)
        if plan.pool_rows is not None:
            x = part.index_select(0, plan.counted) if plan.counted is not None else part
            presence, frequency, repetition = plan.numbers
            self.ops.apply_penalties(x, self._counts, self._seen if plan.use_seen else None, plan.pool_rows, presence,
                                     frequency, repetition)
            if plan.counted is not None:
                part.index_copy_(0, plan.counted, x)
        if plan.stops is not None:
            at, ids, neg = plan.stops
            part.index_put_((at, ids), neg)
        return logits.index_copy(0, plan.idx, sub)

    def _make_plan(self, key: tuple, dev: torch.device) -> _StepPlan:
        """The device tensors :meth:`apply` needs for the penalized rows ``key[0]`` at positions ``key[1]``, the
        rows ``key[2]`` (of them) masking their stop ids."""
        pool_rows, positions, masked = key
        states = [self._state[r] for r in pool_rows]
        bias = None
        biased = [(j, s) for j, s in enumerate(states) if s.bias_ids is not None]
        if biased:
            bias = (torch.cat([torch.full_like(s.bias_ids, j) for j, s in biased]),
                    torch.cat([s.bias_ids for _, s in biased]), torch.cat([s.bias_values for _, s in biased]))
        counted = [j for j, s in enumerate(states) if s.p.counts_tokens]
        plan = _StepPlan(key, to_device(list(positions), torch.int64, dev), bias)
        if masked:
            ids = torch.cat([states[j].stop_ids for j in masked])
            plan.stops = (torch.cat([torch.full_like(states[j].stop_ids, j) for j in masked]), ids,
                          torch.full(ids.shape, float("-inf"), device=dev))
        if counted:
            cs = [states[j] for j in counted]
            plan.counted = to_device(counted, torch.int64, dev) if len(counted) < len(states) else None
            plan.pool_rows = to_device([pool_rows[j] for j in counted], torch.int64, dev)
            numbers = to_device([v for s in cs for v in (s.p.presence, s.p.frequency, s.p.repetition)],
                                torch.float32, dev).view(len(cs), 3).t().contiguous()
            plan.numbers = (numbers[0], numbers[1], numbers[2])
            plan.use_seen = any(s.p.repetition != 1.0 for s in cs)
        return plan

    def record(self, next_ids: torch.Tensor, pool: list[int], rows: list[int], seq_lens: list[int]) -> None:
        """Count the tokens the step sampled (``next_ids`` [bs] int64, on the device) for batch rows ``rows`` whose
        sequence reached their next output position (``seq_lens``: the step's, per batch row)."""
        keep = []
        for i in rows:
            s = self._state.get(pool[i])
            if s is not None and seq_lens[i] >= s.next_len:
                s.next_len = seq_lens[i] + 1
                if s.p.counts_tokens:
                    keep.append(i)
        if not keep:
            return
        dev = next_ids.device
        pool_t = to_device([pool[i] for i in keep], torch.int64, dev)
        tokens = next_ids.index_select(0, to_device(keep, torch.int64, dev))
        self._counts.index_put_((pool_t, tokens), torch.ones(len(keep), device=dev), accumulate=True)
