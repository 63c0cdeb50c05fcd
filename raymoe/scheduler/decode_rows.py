"""DecodeRows: a group's DECODE batch, built in one pass and with the columns that only change with the set of
decoding requests kept from the previous decode step.

Ownership: the group's ``BatchFormation`` (``raymoe.scheduler.batch_formation``) owns one and asks it for each DECODE
batch, after the step's slots were appended to the requests' ``kv_slots``. A DECODE batch of ``bs`` requests has,
per row: the newest token (a placeholder while a step in flight samples it), the slot of its position, its
sequence length, and the request's ReqToTokenPool row (its sampling numbers are on the ranks already,
``raymoe.step.sampling_table``). The row stays the same while the request holds its KV, so the batch keeps the
rows as a column and reuses it (copied) as long as the decoding requests are the same list and no request gave
its KV back since (``GroupState.kv_epoch``); otherwise it takes them again from the requests
(``Req.req_pool_idx``). The per-step columns are read from each request in one loop.

The result equals ``ScheduleBatch.build(reqs, ForwardMode.DECODE, [1] * bs)`` field for field (the tests check it
over random request sequences). Rows that build has to check or may refuse (the first step since an admission,
whose sampling numbers are validated and sent; a row whose KV does not end at its newest token; a row without a
ReqToTokenPool row) make :meth:`DecodeRows.build` answer ``None``, and the caller uses ``ScheduleBatch.build``.
"""

from __future__ import annotations

from raymoe.scheduler.group_state import GroupState
from raymoe.scheduler.req import Req
from raymoe.scheduler.schedule_batch import ScheduleBatch
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.grammar import GrammarRow
from raymoe.step.worker_batch import ModelWorkerBatch


class DecodeRows:
    """Builds the DECODE batches of one group (module docstring).

    Args:
        state: the group's state (its ``kv_epoch`` tells when a request gave its KV back).
    """

    def __init__(self, state: GroupState):
        self.state = state
        self._reqs: list[Req] = []  # the decoding requests the kept columns belong to
        self._epoch = -1
        self._pool_rows: list[int] = []  # [bs] ReqToTokenPool rows
        self._grammar_rows: tuple[GrammarRow, ...] = ()  # the constrained rows (their matchers are on the ranks)

    def _columns_for(self, reqs: list[Req]) -> bool:
        """Make the kept columns those of ``reqs``; False when a request lacks a row, or has not been sent since its
        admission (``table_len == 0``)."""
        epoch = self.state.kv_epoch
        if epoch == self._epoch and reqs == self._reqs:  # the same requests (compared by identity)
            return True
        pool_rows = [r.req_pool_idx for r in reqs]
        if None in pool_rows or any(r.table_len == 0 for r in reqs):
            return False  # a request build has to check first (its table length only grows until it gives KV back)
        grammar_rows = []
        for i, r in enumerate(reqs):
            spec = r.sampling_params.grammar
            if spec is not None:
                if not r.grammar_synced:
                    return False  # its first sampling row: build sends its tokens
                grammar_rows.append(GrammarRow(i, r.rid))
        self._reqs, self._epoch, self._pool_rows = list(reqs), epoch, pool_rows
        self._grammar_rows = tuple(grammar_rows)
        return True

    def build(self, reqs: list[Req]) -> ScheduleBatch | None:
        """The DECODE batch of ``reqs`` (each with this step's slot already appended to its ``kv_slots``), or
        ``None`` when a row needs ``ScheduleBatch.build`` (module docstring). Changes nothing on the requests."""
        if not reqs or not self._columns_for(reqs):
            return None
        input_ids: list[int] = []
        out_cache_loc: list[int] = []
        seq_lens: list[int] = []
        for req in reqs:
            slots = req.kv_slots
            n = len(slots)
            pending = req.pending_ids
            outputs = req.output_ids
            k = len(outputs) + len(pending)
            if n != len(req.origin_input_ids) + k or not n:
                return None
            # The token at position n - 1: the newest placeholder, else the newest output, else the prompt's last.
            input_ids.append(pending[-1] if pending else outputs[-1] if outputs else req.origin_input_ids[-1])
            out_cache_loc.append(slots[-1])
            seq_lens.append(n)
        bs = len(reqs)
        worker_batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE, input_ids=input_ids, req_pool_indices=self._pool_rows[:],
            seq_lens=seq_lens, prefix_lens=[n - 1 for n in seq_lens], extend_lens=[1] * bs,
            out_cache_loc=out_cache_loc, grammar_rows=self._grammar_rows)
        return ScheduleBatch(reqs=list(reqs), partial=[False] * bs, worker_batch=worker_batch)
