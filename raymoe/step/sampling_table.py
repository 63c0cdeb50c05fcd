"""SamplingTable: a rank's sampling numbers per ReqToTokenPool row, so a step carries each request's numbers once.

Ownership: each rank's ``ModelRunner`` owns one (test ranks and fake executors may own one too: it holds plain
Python data, no tensors). A ``ModelWorkerBatch`` built by a scheduler carries no per-step sampling record: the
first step after a request's admission carries its :class:`~raymoe.step.sampling_inputs.SamplingRow`
(``ModelWorkerBatch.sampling_rows``), the table keeps it under the request's ReqToTokenPool row, and
:meth:`SamplingTable.resolve` assembles each step's :class:`~raymoe.step.sampling_inputs.SamplingInputs` from the
batch's rows. A row is written again by the next request admitted to it before any step of that request reads it
(the scheduler sends a row on every admission, ``table_len == 0``), so nothing is ever erased.

Why: at 256 running requests the per-step sampling record was 9.4 KB of a 13.8 KB decode batch, pickled by the
group scheduler and unpickled by every rank of the group each step, though it changes only when a request is
admitted. While a group's rows stay the same (steady decode), the columns are kept from the previous step and only
``output_lens`` is derived again, from ``seq_lens`` (``SamplingRow.prompt_len``).
"""

from __future__ import annotations

from raymoe.step.sampling_inputs import SamplingInputs, SamplingRow
from raymoe.step.worker_batch import ModelWorkerBatch


class SamplingTable:
    """Sampling numbers per ReqToTokenPool row, written by the steps that admit requests (module docstring)."""

    def __init__(self) -> None:
        self._rows: dict[int, SamplingRow] = {}
        self._pool_rows: list[int] | None = None  # the rows the kept columns belong to, in batch order
        self._columns: list[list] = []  # the SamplingRow columns of those rows

    def resolve(self, batch: ModelWorkerBatch) -> SamplingInputs | None:
        """The step's sampling record: ``batch.sampling`` where the batch carries a whole one (tests, benchmarks),
        else assembled from the rows this table holds after writing ``batch.sampling_rows``. None for a batch
        without requests.

        ``output_lens[i] = max(seq_lens[i] - prompt_len, 0)``: the tokens generated so far for every row that
        samples this step (a partial prefill chunk's row, whose token is dropped, reads a clamped value).

        Raises:
            ValueError: a row of the batch was never sent its numbers (a step since its request's admission was
                lost), naming the ReqToTokenPool row.
        """
        if batch.sampling is not None:
            return batch.sampling
        pool = batch.req_pool_indices
        if not pool:
            return None
        for i, row in batch.sampling_rows:
            self._rows[pool[i]] = row
        if batch.sampling_rows or pool != self._pool_rows:
            try:
                rows = [self._rows[r] for r in pool]
            except KeyError as e:
                raise ValueError(f"ReqToTokenPool row {e.args[0]} has no sampling numbers on this rank: no step "
                                 "since its request's admission carried its SamplingRow") from None
            self._columns = [list(c) for c in zip(*rows, strict=True)]
            self._pool_rows = list(pool)
        temperatures, top_ps, top_ks, min_ps, seeds, logprobs, prompt_lens = self._columns[:7]
        output_lens = [n - p if n > p else 0 for n, p in zip(batch.seq_lens, prompt_lens, strict=True)]
        return SamplingInputs(temperatures=temperatures, top_ps=top_ps, top_ks=top_ks, min_ps=min_ps, seeds=seeds,
                              output_lens=output_lens, logprobs=logprobs)
