"""The numbers that end a request, computed once per admission, so that the per-step checks are a few comparisons.

Ownership: the group's batch formation computes a :class:`StopLimits` for each request it admits
(``raymoe.scheduler.batch_formation``) and stores it on the request (``Req.limits``); the per-step hot paths read
it: which running requests still decode (``GroupState.decoders``) and whether a sampled token ends a request
(``raymoe.scheduler.results``). Both fall back to the full checks of ``Req`` (``length_capped``, ``check_finished``)
whenever the limits cannot answer alone (no limits yet, a stop token or stop strings, a length limit reached), so
the fast paths decide exactly as those checks do. The sampling parameters are frozen once a request is admitted
(``raymoe.scheduler.sampling_params``), and the group's context length, pool size and EOS ids never change.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from raymoe.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopLimits:
    """What ends one request, as the group sees it.

    Attributes:
        output_cap: output tokens (sampled or pending) at which a length limit ends the request: the least of
            ``max_tokens``, ``max_context_len - prompt`` (prompt + output reaches the context) and
            ``kv_pool_size + 1 - prompt`` (the next decode step would need more KV than the whole pool).
        stop_ids: token ids that end it when sampled: its ``stop_token_ids``, and the model's EOS ids unless
            ``ignore_eos``.
        stop_strings: whether it has stop strings (each new token then needs the text check).
    """

    output_cap: int
    stop_ids: frozenset[int]
    stop_strings: bool


def stop_limits(prompt_len: int, params: SamplingParams, eos_token_ids: Iterable[int], max_context_len: int,
                kv_pool_size: int) -> StopLimits:
    """The :class:`StopLimits` of a request with a ``prompt_len``-token prompt and ``params`` in a group whose
    context holds ``max_context_len`` tokens and whose KV pool has ``kv_pool_size`` slots."""
    cap = min(params.max_tokens, max_context_len - prompt_len, kv_pool_size + 1 - prompt_len)
    ids = frozenset(params.stop_token_ids) if params.ignore_eos else frozenset(params.stop_token_ids).union(
        eos_token_ids)
    return StopLimits(cap, ids, bool(params.stop))
