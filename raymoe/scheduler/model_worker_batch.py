"""Typed handoff records between the scheduler (driver side) and the runner (rank side).

Ownership: the scheduler builds a :class:`ModelWorkerBatch` from its ``ScheduleBatch``; it holds only plain
Python numbers and lists (no tensors, no scheduler objects), so it can cross a Ray actor boundary cheaply.
The rank's ``ModelRunner`` turns it into a tensor ``ForwardBatch`` and answers with a :class:`StepOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raymoe.runner.forward_mode import ForwardMode


@dataclass(frozen=True)
class ModelWorkerBatch:
    """One step's work for one DP-attention group, as plain data.

    Shapes (``bs`` = number of requests, ``T`` = number of tokens this step = ``sum(extend_lens)``):

    Attributes:
        forward_mode: EXTEND, DECODE, MIXED or IDLE (IDLE: ``bs == T == 0``).
        input_ids: ``T`` token ids, request after request.
        req_pool_indices: ``bs`` rows of the rank's ``ReqToTokenPool`` table.
        seq_lens: ``bs`` sequence lengths in tokens *after* this step's tokens are added.
        prefix_lens: ``bs`` tokens already in the KV cache before this step (``seq_len - extend_len``).
        extend_lens: ``bs`` tokens computed this step per request (1 for decode rows).
        out_cache_loc: ``T`` KV slots that receive this step's keys/values (slot 0 is the dummy slot).
        prefix_slots: for EXTEND/MIXED, the concatenation over requests of the KV slots of positions
            ``[0, prefix_len)`` (so ``len == sum(prefix_lens)``), written into the rank's table; empty for DECODE.
        temperatures, top_ps, top_ks, min_ps: ``bs`` sampling parameters (``top_k <= 0`` disables top-k).
        seeds: ``bs`` per-request seeds or ``None`` (unseeded rows use the rank's generator).
        output_lens: ``bs`` tokens generated so far per request (seeded sampling draws from ``(seed, output_len)``).
        logprobs: ``bs`` number of top log-probs wanted per request, ``None`` for none.
        use_tbo: run this step with two-batch overlap (decided once by the driver for all ranks).
        graph_bs: padded batch size of the captured graph to replay, or ``None`` for eager.
        global_num_tokens: tokens per DP group this step (all ranks agree; used for MoE buffer sizing).
    """

    forward_mode: ForwardMode
    input_ids: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]
    prefix_slots: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    min_ps: list[float] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    logprobs: list[int | None] = field(default_factory=list)
    use_tbo: bool = False
    graph_bs: int | None = None
    global_num_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bs = len(self.req_pool_indices)
        for name in ("seq_lens", "prefix_lens", "extend_lens"):
            if len(getattr(self, name)) != bs:
                raise ValueError(f"ModelWorkerBatch.{name} has {len(getattr(self, name))} entries, expected {bs}")
        num_tokens = len(self.input_ids)
        if len(self.out_cache_loc) != num_tokens:
            raise ValueError("ModelWorkerBatch.out_cache_loc must have one slot per input token")
        if self.forward_mode == ForwardMode.IDLE and (bs or num_tokens):
            raise ValueError("an IDLE ModelWorkerBatch carries no requests")

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def idle(cls, global_num_tokens: tuple[int, ...] = (), use_tbo: bool = False) -> "ModelWorkerBatch":
        """An IDLE batch: zero requests and tokens, so the rank still enters every MoE collective."""
        return cls(
            forward_mode=ForwardMode.IDLE, input_ids=[], req_pool_indices=[], seq_lens=[], prefix_lens=[],
            extend_lens=[], out_cache_loc=[], global_num_tokens=global_num_tokens, use_tbo=use_tbo,
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled token: its own and the ``k`` most likely alternatives."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class StepOutput:
    """What a rank answers for one step (only tp-rank 0 of each DP group answers with tokens).

    Attributes:
        next_token_ids: ``bs`` sampled token ids (for chunked-prefill rows that are not finished the driver
            discards them).
        logprobs: ``bs`` entries, ``None`` where the request asked for none.
        forward_seconds: wall time of forward + sampling on the rank, seconds.
    """

    next_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    forward_seconds: float = 0.0
