"""ScheduleBatch: one step's requests as the scheduler decided them (driver side).

Ownership: built by the ``Scheduler`` after it has allocated the step's KV slots (they are already appended to
each request's ``kv_slots``); read back by ``Scheduler.process_batch_result``. It snapshots every number the
step needs at build time, so later changes to the requests (an abort, a retraction) cannot alter a batch that is
in flight. :meth:`ScheduleBatch.to_model_worker_batch` turns it into the plain-data ``ModelWorkerBatch`` that
ranks receive. The set of decoding requests itself is a plain list on the scheduler, not a batch object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.scheduler.req import Req
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch


@dataclass(frozen=True)
class ScheduleBatch:
    """Requests of one step with their token ranges and KV slots (``bs`` requests, ``T`` tokens).

    Attributes:
        reqs: the ``bs`` requests, in batch order.
        forward_mode: EXTEND (prefill or a prefill chunk) or DECODE.
        input_ids: ``T`` token ids fed this step, request after request.
        prefix_lens: ``bs`` tokens already covered by KV before this step.
        extend_lens: ``bs`` tokens computed this step (1 per decode row).
        out_cache_loc: ``T`` KV slots written this step.
        prefix_slots: for EXTEND, slots of positions ``[0, prefix_len)`` of every request, concatenated.
        req_pool_indices: ``bs`` ReqToTokenPool rows of the requests.
        output_lens: ``bs`` tokens generated before this step.
        partial: ``bs`` flags, true for a prefill chunk that does not reach the end of ``fill_ids`` (its sampled
            token is discarded).
    """

    reqs: list[Req]
    forward_mode: ForwardMode
    input_ids: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]
    prefix_slots: list[int]
    req_pool_indices: list[int]
    output_lens: list[int]
    partial: list[bool]

    @classmethod
    def build(cls, reqs: Sequence[Req], forward_mode: ForwardMode, extend_lens: Sequence[int]) -> ScheduleBatch:
        """Snapshot a step from request state whose ``kv_slots`` already end with this step's slots.

        For request ``r`` with extend length ``e``, the step computes positions ``[r.kv_len - e, r.kv_len)`` of
        ``r.fill_ids`` into slots ``r.kv_slots[-e:]``.

        Raises:
            ValueError: ``forward_mode`` is not EXTEND or DECODE, a decode row has ``e != 1``, ``e < 1``, a
                request's KV would run past its ``fill_ids``, or a request holds no ReqToTokenPool row.
        """
        if forward_mode not in (ForwardMode.EXTEND, ForwardMode.DECODE):
            raise ValueError(f"ScheduleBatch supports EXTEND and DECODE, got {forward_mode!r}")
        if len(reqs) != len(extend_lens):
            raise ValueError("one extend length per request is required")
        decode = forward_mode == ForwardMode.DECODE
        input_ids: list[int] = []
        out_cache_loc: list[int] = []
        prefix_slots: list[int] = []
        prefix_lens: list[int] = []
        partial: list[bool] = []
        for req, e in zip(reqs, extend_lens, strict=True):
            end = req.kv_len
            start = end - e
            if e < 1 or start < 0 or end > req.seq_len or (decode and e != 1):
                raise ValueError(f"request {req.rid!r}: bad extend length {e} for kv_len {end}, seq_len {req.seq_len}")
            if req.req_pool_idx is None:
                raise ValueError(f"request {req.rid!r} holds no ReqToTokenPool row")
            input_ids += req.tokens(start, end)
            out_cache_loc += req.kv_slots[start:end]
            if not decode:
                prefix_slots += req.kv_slots[:start]
            prefix_lens.append(start)
            partial.append(end < req.seq_len)
        return cls(
            reqs=list(reqs), forward_mode=forward_mode, input_ids=input_ids, prefix_lens=prefix_lens,
            extend_lens=list(extend_lens), out_cache_loc=out_cache_loc, prefix_slots=prefix_slots,
            req_pool_indices=[r.req_pool_idx for r in reqs], output_lens=[len(r.output_ids) for r in reqs],
            partial=partial,
        )

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> list[int]:
        """``bs`` sequence lengths after this step (``prefix_len + extend_len``)."""
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    def to_model_worker_batch(self) -> ModelWorkerBatch:
        """The plain-data record ranks receive (fresh lists; no scheduler objects), built from the snapshot."""
        params = [r.sampling_params for r in self.reqs]
        sampling = SamplingInputs(
            temperatures=[float(p.temperature) for p in params],
            top_ps=[float(p.top_p) for p in params],
            top_ks=[int(p.top_k) for p in params],
            min_ps=[float(p.min_p) for p in params],
            seeds=[p.seed for p in params],
            output_lens=list(self.output_lens),
            logprobs=[p.logprobs for p in params],
        )
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=list(self.input_ids),
            req_pool_indices=list(self.req_pool_indices),
            seq_lens=self.seq_lens,
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            out_cache_loc=list(self.out_cache_loc),
            prefix_slots=list(self.prefix_slots) if self.forward_mode.is_extend() else [],
            sampling=sampling,
        )
