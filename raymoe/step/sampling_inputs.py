"""SamplingInputs: the per-row sampling numbers of one step, as one record (plain data, no tensors), and
SamplingRow, one request's numbers as a step carries them to the ranks once per admission.

Ownership: the scheduler turns each request's ``SamplingParams`` into a :class:`SamplingRow` on the first step
after its admission (``ScheduleBatch.build``) and ships it inside that step's ``ModelWorkerBatch``; each rank keeps
it for the request's ReqToTokenPool row (``raymoe.step.sampling_table``) and assembles every step's
:class:`SamplingInputs` from those rows, so later steps carry no sampling numbers at all (vLLM's cached request
data follows the same idea). The rank's ``SamplingBatchInfo.from_inputs`` turns the record into tensors for the
``Sampler``. The values themselves are validated once, in ``SamplingParams``; this record only checks that every
list has one entry per row.

The per-row fields are declared once, in :class:`SamplingRows`, generic in how a column of floats (``FloatRows``)
and of integers (``IntRows``) is held: Python lists here, tensors in ``raymoe.runner.forward_batch``'s
``SamplingBatchInfo``, which derives from the same class. A new per-row field is one edit there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, NamedTuple, TypeVar

from raymoe.step.logit_penalties import LogitPenalties

FloatRows = TypeVar("FloatRows")
"""How a column of per-row floats is held (``list[float]``, or a [bs] float32 tensor on the rank)."""
IntRows = TypeVar("IntRows")
"""How a column of per-row integers is held (``list[int]``, or a [bs] int64 tensor on the rank)."""


@dataclass(frozen=True)
class SamplingRows(Generic[FloatRows, IntRows]):
    """Sampling parameters of ``bs`` rows, one entry per row in batch order.

    Attributes:
        temperatures: softmax temperatures (``0.0``: greedy).
        top_ps: nucleus mass in ``(0, 1]`` (``1.0``: off).
        top_ks: most likely tokens kept (``<= 0``: off; ``1``: greedy).
        min_ps: minimum probability relative to the most likely token, in ``[0, 1]`` (``0.0``: off).
        seeds: per-request seeds, or ``None`` (unseeded rows use the rank's generator).
        output_lens: tokens generated so far per request (seeded sampling draws from ``(seed, output_len)``).
        logprobs: number of top log-probs wanted per request, ``None`` for none.
    Raises:
        ValueError: the columns differ in length (the message names the field).
    """

    temperatures: FloatRows
    top_ps: FloatRows
    top_ks: IntRows
    min_ps: FloatRows
    seeds: list[int | None]
    output_lens: list[int]
    logprobs: list[int | None]

    def __post_init__(self) -> None:
        bs = len(self.temperatures)
        for f in fields(SamplingRows):
            n = len(getattr(self, f.name))
            if n != bs:
                raise ValueError(f"{type(self).__name__}.{f.name} has {n} entries, expected {bs} (one per row)")

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return len(self.temperatures)


@dataclass(frozen=True)
class SamplingInputs(SamplingRows[list[float], list[int]]):
    """The driver's per-row sampling record: every column a Python list (see :class:`SamplingRows`)."""

    @property
    def all_greedy(self) -> bool:
        """Every row takes the most likely token (temperature 0 or top-k 1), so the sampler can skip sampling."""
        return all(t == 0.0 or k == 1 for t, k in zip(self.temperatures, self.top_ks, strict=True))

    @property
    def needs_filter(self) -> bool:
        """Some row restricts its candidates (top-k > 0, top-p < 1 or min-p > 0), so the sampler sorts the
        vocabulary; decided here, on the host, so the rank never reads its tensors back to ask."""
        return any(k > 0 for k in self.top_ks) or any(p < 1.0 for p in self.top_ps) or any(m > 0.0 for m in self.min_ps)

    @classmethod
    def greedy(cls, bs: int = 0) -> SamplingInputs:
        """``bs`` greedy rows without seeds or log-probs (``bs = 0``: the empty record of an IDLE batch)."""
        return cls(temperatures=[0.0] * bs, top_ps=[1.0] * bs, top_ks=[-1] * bs, min_ps=[0.0] * bs,
                   seeds=[None] * bs, output_lens=[0] * bs, logprobs=[None] * bs)


class SamplingRow(NamedTuple):
    """One request's sampling numbers as they reach the ranks, once per admission (module docstring).

    Attributes:
        temperature, top_p, top_k, min_p, seed, logprobs: as in :class:`SamplingRows` (one row of each column).
        prompt_len: the request's prompt length, tokens. A row that samples this step has ``seq_len =
            prompt_len + tokens generated so far`` (its sequence ends at its newest token), so the rank derives
            each step's ``output_lens`` (the position a seeded draw is made at) from ``seq_lens`` without being
            sent it.
        penalties: the request's penalties and logit bias (``raymoe.step.logit_penalties``), None without any.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    logprobs: int | None
    prompt_len: int
    penalties: LogitPenalties | None = None
