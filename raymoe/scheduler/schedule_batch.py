"""ScheduleBatch: one step's requests as the scheduler decided them (driver side).

Ownership: built by the ``Scheduler`` after it has allocated the step's KV slots (they are already appended to
each request's ``kv_slots``); read back by ``Scheduler.process_batch_result``. It snapshots every number the
step needs at build time, so later changes to the requests (an abort, a retraction) cannot alter a batch that is
in flight. The step's numbers live in one record, the plain-data ``ModelWorkerBatch`` that ranks receive
(``ScheduleBatch.worker_batch``, built once by :meth:`ScheduleBatch.build`); the ScheduleBatch adds only what
the scheduler needs to apply the result (the requests, and which rows are unfinished prefill chunks). The set of
decoding requests itself is a plain list on the scheduler, not a batch object.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from raymoe.scheduler.req import Req, RequestFault, RequestFaultError
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch


@dataclass(frozen=True)
class ScheduleBatch:
    """Requests of one step and the step's record for the ranks (``bs`` requests).

    Attributes:
        reqs: the ``bs`` requests, in batch order.
        partial: ``bs`` flags, true for a prefill chunk that does not reach the end of ``fill_ids`` (its sampled
            token is discarded).
        worker_batch: the step as plain data (token ids, lengths, rows, KV slots, sampling inputs), EXTEND
            (prefill or a prefill chunk) or DECODE.
    Raises:
        ValueError: ``reqs``, ``partial`` and ``worker_batch`` disagree on ``bs``.
    """

    reqs: list[Req]
    partial: list[bool]
    worker_batch: ModelWorkerBatch

    def __post_init__(self) -> None:
        if not len(self.reqs) == len(self.partial) == self.worker_batch.batch_size:
            raise ValueError(f"ScheduleBatch has {len(self.reqs)} requests, {len(self.partial)} partial flags and "
                             f"{self.worker_batch.batch_size} worker-batch rows")

    @classmethod
    def build(cls, reqs: Sequence[Req], forward_mode: ForwardMode, extend_lens: Sequence[int]) -> ScheduleBatch:
        """Snapshot a step from request state whose ``kv_slots`` already end with this step's slots.

        For request ``r`` with extend length ``e``, the step computes positions ``[r.kv_len - e, r.kv_len)`` of
        ``r.fill_ids`` into slots ``r.kv_slots[-e:]``; an EXTEND step also carries the slots of positions
        ``[0, r.kv_len - e)`` for the rank's table.

        Raises:
            ValueError: ``forward_mode`` is not EXTEND or DECODE, or the lengths do not match the requests.
            RequestFaultError: one request's row cannot be built (a decode row has ``e != 1``, ``e < 1``, its KV
                would run past its ``fill_ids``, it holds no ReqToTokenPool row, or its sampling parameters
                cannot be represented on the ranks); the caller fails that request and builds again without it.
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
                raise RequestFaultError(req, RequestFault(
                    "failed", f"bad extend length {e} for kv_len {end}, seq_len {req.seq_len}"))
            if req.req_pool_idx is None:
                raise RequestFaultError(req, RequestFault("failed", "the request holds no KV row"))
            if not decode:  # every request is extended before it decodes, and its parameters are frozen
                check_sampling_row(req)
            input_ids += req.tokens(start, end)
            out_cache_loc += req.kv_slots[start:end]
            if not decode:
                prefix_slots += req.kv_slots[:start]
            prefix_lens.append(start)
            partial.append(end < req.seq_len)
        worker_batch = ModelWorkerBatch(
            forward_mode=forward_mode,
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens, strict=True)],
            prefix_lens=prefix_lens,
            extend_lens=list(extend_lens),
            out_cache_loc=out_cache_loc,
            prefix_slots=prefix_slots,
            sampling=_sampling_inputs(reqs),
        )
        return cls(reqs=list(reqs), partial=partial, worker_batch=worker_batch)

    @property
    def batch_size(self) -> int:
        """Number of requests."""
        return len(self.reqs)


_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def check_sampling_row(req: Req) -> None:
    """Check that ``req``'s sampling numbers can be put into the ranks' tensors (float32/int64) and generators.

    ``SamplingParams`` validates ranges already; this is the last check before a row leaves the driver, so that a
    value no rank can represent fails this one request instead of the whole step on every rank.

    Raises:
        RequestFaultError: kind ``"invalid"``, naming the field.
    """
    p = req.sampling_params

    def bad(name: str, why: str) -> RequestFaultError:
        return RequestFaultError(req, RequestFault("invalid", why, field=name))

    for name in ("temperature", "top_p", "min_p"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
            raise bad(name, f"must be a finite number a float32 can hold, got {v!r}")
    for name in ("top_k", "seed", "logprobs"):
        v = getattr(p, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not -1 <= v <= _INT64_MAX):
            raise bad(name, f"must be an integer in [-1, 2**63 - 1], got {v!r}")


def _sampling_inputs(reqs: Sequence[Req]) -> SamplingInputs:
    """Each request's sampling parameters and the tokens it has generated so far, one row per request."""
    params = [r.sampling_params for r in reqs]
    return SamplingInputs(
        temperatures=[float(p.temperature) for p in params],
        top_ps=[float(p.top_p) for p in params],
        top_ks=[int(p.top_k) for p in params],
        min_ps=[float(p.min_p) for p in params],
        seeds=[p.seed for p in params],
        output_lens=[len(r.output_ids) for r in reqs],
        logprobs=[p.logprobs for p in params],
    )
