"""ModelWorkerBatch: one step's work for one DP-attention group, the typed driver -> rank handoff.

Ownership: the scheduler builds it from its ``ScheduleBatch`` (the driver builds IDLE batches and sets the
step-wide decisions ``use_tbo``, ``graph_bs`` and ``global_num_tokens``). It holds only plain Python numbers and
lists (no tensors, no scheduler objects), so it crosses a Ray actor boundary cheaply. The rank's ``ModelRunner``
turns it into a tensor ``ForwardBatch`` and answers with a ``StepOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raymoe.step.expert_update import ExpertUpdate
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.grammar import GrammarRow
from raymoe.step.kv_stream import KVStreamChunk
from raymoe.step.prompt_scores import PromptScoreRow
from raymoe.step.sampling_inputs import SamplingInputs, SamplingRow


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
            ``[table_len, prefix_len)`` (so ``len == sum(prefix_lens) - sum(table_lens)``), written into the rank's
            table; empty for DECODE.
        table_lens: for EXTEND/MIXED, ``bs`` counts of leading positions each request's table row already holds
            from earlier steps (a continued prefill chunk, or a decode row of a MIXED batch), whose slots are not
            resent; empty means all zeros.
        sampling: ``bs`` rows of sampling parameters, or None (what schedulers send): the ranks assemble them
            from the rows they were sent (``raymoe.step.sampling_table``).
        sampling_rows: ``(row, SamplingRow)`` for the rows whose requests were admitted since their last step
            (their first step), ascending by row; the ranks keep each under its ReqToTokenPool row.
        use_tbo: run this step with two-batch overlap (decided once by the driver for all ranks).
        graph_bs: padded batch size of the captured graph to replay, or ``None`` for eager.
        global_num_tokens: tokens per DP group this step (all ranks agree; used for MoE buffer sizing).
        dispatch_capacity: per-rank token capacity M of this step's low-latency MoE dispatch, the same on every
            rank (``raymoe.comm.a2a_plan``); None: normal-mode dispatch.
        expert_update: the step's expert load balancing work, the same on every rank (``raymoe.step.expert_update``;
            the rank applies it before the forward), or None.
        grammar_rows: the rows whose requests constrain their output (``raymoe.step.grammar``), ascending; empty
            when none does.
        spec_next_ids: speculative decoding with the model's MTP layer (``nextn``): ``bs`` ids, per row the
            prompt token after its last position for a prefill chunk that does not sample, else -1 (the row's
            sampled token follows it); empty otherwise (``raymoe.runner.mtp_drafter``).
        draft_passes: the ranks run the draft model after this step (``nextn`` / ``eagle``; the same on every rank,
            decided by the driver).
        draft_graph_bs: the graph bucket of the draft model's decode passes, the same on every rank (a bound of
            every group's rows); None: eager passes.
        draft_lens: speculative decoding: ``bs`` counts of draft tokens at the end of each row (a TARGET_VERIFY row
            is its newest token and its drafts; a MIXED batch's decode rows may verify drafts too, its prefill rows
            have none); empty: none.
        spec_scratch_slots: ``nextn``: KV slots for the draft chain, ``speculative_num_steps - 1`` per row that
            samples, in row order (empty: drafts of one token only this step).
        kv_streams: prefill/decode disaggregation: the prompt rows of this step's streamed requests that each
            rank writes into the decode engine's slots layer by layer (``raymoe.step.kv_stream``); empty: none.
        prompt_score_rows: the prefill rows whose prompt positions the ranks score (``prompt_logprobs``,
            ``raymoe.step.prompt_scores``), ascending; empty: none.
    Raises:
        ValueError: a per-request list or ``sampling`` does not have ``bs`` entries, ``out_cache_loc`` does not
            have ``T``, ``prefix_slots`` does not match ``prefix_lens - table_lens``, an IDLE batch carries
            requests or tokens, or a grammar or sampling row is outside the batch.
    """

    forward_mode: ForwardMode
    input_ids: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]
    prefix_slots: list[int] = field(default_factory=list)
    sampling: SamplingInputs | None = None
    use_tbo: bool = False
    graph_bs: int | None = None
    global_num_tokens: tuple[int, ...] = ()
    dispatch_capacity: int | None = None
    table_lens: list[int] = field(default_factory=list)
    expert_update: ExpertUpdate | None = None
    grammar_rows: tuple[GrammarRow, ...] = ()
    sampling_rows: tuple[tuple[int, SamplingRow], ...] = ()
    spec_next_ids: tuple[int, ...] = ()
    spec_scratch_slots: tuple[int, ...] = ()
    draft_lens: tuple[int, ...] = ()
    draft_passes: bool = False
    kv_streams: tuple[KVStreamChunk, ...] = ()
    draft_graph_bs: int | None = None
    prompt_score_rows: tuple[PromptScoreRow, ...] = ()

    def __post_init__(self) -> None:
        bs = len(self.req_pool_indices)
        if self.table_lens and len(self.table_lens) != bs:
            raise ValueError(f"ModelWorkerBatch.table_lens has {len(self.table_lens)} entries, expected {bs}")
        if self.forward_mode.is_extend():
            want = sum(self.prefix_lens) - sum(self.table_lens)
            if len(self.prefix_slots) != want:
                raise ValueError(f"ModelWorkerBatch.prefix_slots has {len(self.prefix_slots)} entries, expected "
                                 f"{want} (prefix_lens - table_lens)")
        for name in ("seq_lens", "prefix_lens", "extend_lens"):
            if len(getattr(self, name)) != bs:
                raise ValueError(f"ModelWorkerBatch.{name} has {len(getattr(self, name))} entries, expected {bs}")
        if self.sampling is not None and self.sampling.batch_size != bs:
            raise ValueError(f"ModelWorkerBatch.sampling has {self.sampling.batch_size} rows, expected {bs}")
        num_tokens = len(self.input_ids)
        if len(self.out_cache_loc) != num_tokens:
            raise ValueError("ModelWorkerBatch.out_cache_loc must have one slot per input token")
        if self.forward_mode == ForwardMode.IDLE and (bs or num_tokens):
            raise ValueError("an IDLE ModelWorkerBatch carries no requests")
        _check_capacity(self.dispatch_capacity, num_tokens)
        if self.grammar_rows and any(not 0 <= g.row < bs for g in self.grammar_rows):
            raise ValueError(f"ModelWorkerBatch.grammar_rows names a row outside [0, {bs})")
        if self.sampling_rows and not 0 <= self.sampling_rows[0][0] <= self.sampling_rows[-1][0] < bs:
            raise ValueError(f"ModelWorkerBatch.sampling_rows names a row outside [0, {bs})")
        if self.spec_next_ids and len(self.spec_next_ids) != bs:
            raise ValueError(f"ModelWorkerBatch.spec_next_ids has {len(self.spec_next_ids)} entries, expected {bs}")
        if self.draft_lens and (len(self.draft_lens) != bs or any(
                not 0 <= k < e for k, e in zip(self.draft_lens, self.extend_lens, strict=True))):
            raise ValueError("ModelWorkerBatch.draft_lens needs one count per row, each below its extend length")
        for s in self.prompt_score_rows:
            if not (0 <= s.row < bs and s.num_positions <= self.extend_lens[s.row]):
                raise ValueError(f"ModelWorkerBatch.prompt_score_rows: {s} is outside the batch or its row's chunk")
        if self.spec_scratch_slots and not self.spec_next_ids:
            raise ValueError("ModelWorkerBatch.spec_scratch_slots go with spec_next_ids")

    def with_step_decisions(self, global_num_tokens: tuple[int, ...], use_tbo: bool, graph_bs: int | None,
                            dispatch_capacity: int | None, expert_update: ExpertUpdate | None = None,
                            draft_passes: bool = False, draft_graph_bs: int | None = None) -> ModelWorkerBatch:
        """A copy with the step-wide fields set (the driver's decisions for every rank). The per-request columns
        were checked when this batch was built and are shared with the copy (no one changes a batch's lists), so
        only the rule the new fields enter is checked again, once: the dispatch capacity holds the tokens.

        Raises:
            ValueError: ``dispatch_capacity`` is below 1 or below the batch's tokens.
        """
        _check_capacity(dispatch_capacity, len(self.input_ids))
        copy = object.__new__(ModelWorkerBatch)
        state = copy.__dict__
        state.update(self.__dict__)
        state.update(global_num_tokens=global_num_tokens, use_tbo=use_tbo, graph_bs=graph_bs,
                     dispatch_capacity=dispatch_capacity, expert_update=expert_update, draft_passes=draft_passes,
                     draft_graph_bs=draft_graph_bs)
        return copy

    @property
    def batch_size(self) -> int:
        """Number of requests (rows)."""
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        """Number of tokens computed this step."""
        return len(self.input_ids)

    @classmethod
    def idle(cls, global_num_tokens: tuple[int, ...] = (), use_tbo: bool = False) -> ModelWorkerBatch:
        """An IDLE batch: zero requests and tokens, so the rank still enters every MoE collective."""
        return cls(
            forward_mode=ForwardMode.IDLE, input_ids=[], req_pool_indices=[], seq_lens=[], prefix_lens=[],
            extend_lens=[], out_cache_loc=[], global_num_tokens=global_num_tokens, use_tbo=use_tbo,
        )


def _check_capacity(cap: int | None, num_tokens: int) -> None:
    """A low-latency dispatch capacity (None: normal mode) must be >= 1 and hold the batch's ``num_tokens``."""
    if cap is not None and (cap < 1 or num_tokens > cap):
        raise ValueError(f"ModelWorkerBatch.dispatch_capacity {cap} must be >= 1 and hold its {num_tokens} tokens")
