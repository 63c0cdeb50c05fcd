"""ForwardBatch: the rank-side tensor view of one step (owned by the ModelRunner).

Built from the driver's plain-data ``ModelWorkerBatch``; attention backends and model layers read it, the
sampler reads its ``sampling`` record. Nothing here refers to scheduler objects.

The per-token and per-row fields are declared once, in :attr:`ForwardBatch.TOKEN_TENSORS`,
:attr:`ForwardBatch.ROW_TENSORS` and :attr:`ForwardBatch.ROW_LISTS`: the decode-graph buffers
(``raymoe.runner.graph_buffers``) allocate, pad and copy by these names, and :meth:`ForwardBatch.narrow` (the
two-batch-overlap children, ``raymoe.overlap.split``) slices by them. A new per-token or per-row field is one
edit here (plus its padding value in ``graph_buffers.PADDING``, which is checked at import). Per-token tensors
only some batches have (:attr:`ForwardBatch.OPTIONAL_TOKEN_TENSORS`: a graph bucket's ``padding_mask``) are
sliced with the others where present.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from raymoe.step.forward_mode import ForwardMode
from raymoe.step.host_transfer import to_device
from raymoe.step.sampling_inputs import SamplingInputs, SamplingRows
from raymoe.step.worker_batch import ModelWorkerBatch


@dataclass(frozen=True)
class SamplingBatchInfo(SamplingRows[torch.Tensor, torch.Tensor]):
    """Per-row sampling parameters on the rank's device, ``bs`` rows (fields declared by :class:`SamplingRows`).

    ``temperatures``/``top_ps``/``min_ps`` [bs] float32, ``top_ks`` [bs] int64 (<= 0: off); ``seeds``,
    ``output_lens`` and ``logprobs`` stay Python lists (the seeded rows' draws and the log-prob answers are made
    from them on the host); ``all_greedy`` skips sampling and ``needs_filter`` says whether any row filters its
    candidates (both host booleans: the sampler never reads a tensor back to decide).
    """

    # The tensor dtype of each generic column of SamplingRows; the other fields are host lists.
    DTYPES: ClassVar[dict[str, torch.dtype]] = {"FloatRows": torch.float32, "IntRows": torch.int64}

    all_greedy: bool
    needs_filter: bool

    @classmethod
    def from_inputs(cls, s: SamplingInputs, device: torch.device | str) -> SamplingBatchInfo:
        """Tensorize the driver's per-row sampling record on ``device`` (copies without a host sync)."""
        columns: dict[str, Any] = {}
        for f in dataclasses.fields(SamplingRows):
            value = getattr(s, f.name)
            dtype = cls.DTYPES.get(f.type)
            columns[f.name] = list(value) if dtype is None else to_device(value, dtype, device)
        return cls(**columns, all_greedy=s.all_greedy, needs_filter=s.needs_filter)


_untyped = [f.name for f in dataclasses.fields(SamplingRows)
            if f.type not in SamplingBatchInfo.DTYPES and not str(f.type).startswith("list[")]
if _untyped:  # a new SamplingRows column must be a generic column (a tensor here) or a host list
    raise TypeError(f"SamplingRows fields {_untyped} are neither FloatRows/IntRows columns nor lists")


@dataclass
class ForwardBatch:
    """One step's inputs on the rank's device.

    Shapes: ``input_ids``, ``positions``, ``out_cache_loc`` [T] int64; ``req_pool_indices``, ``seq_lens`` [bs]
    int64. The ``*_cpu`` lists mirror lengths in tokens for host-side loops. ``sample_indices`` [bs] int64 are
    the rows of the hidden states whose logits are sampled (each request's last token this step). ``graph_bs``: the
    driver's padded decode-graph bucket for this step (``None``: eager). Two-batch overlap
    (``raymoe.overlap.split``): ``tbo_children`` are the two halves of a TBO step; a child's
    ``tbo_parent_token_range`` (start, end) are the parent rows it covers. ``dispatch_capacity``: per-rank token
    capacity of this (child) batch's low-latency MoE dispatch (None: normal mode; ``raymoe.comm.a2a_plan``).
    ``padding_mask``: [T] bool, True on the padding rows of a decode graph's bucket (``raymoe.runner.graph_buffers``),
    whose MoE pairs go to no expert; None (eager batches): every token is real. ``kv_stream``: the step's
    layer-by-layer KV writer of a PD prefill rank (``raymoe.kvcache.kv_stream.KVLayerStream``, shared by the TBO
    children); None on every other step. ``draft_lens_cpu``: speculative decoding: per request, the draft tokens
    at the end of its row (``ModelWorkerBatch.draft_lens``; a TARGET_VERIFY row without them: all but its first
    token); None on steps that verify nothing.

    Raises:
        ValueError: a token tensor does not have as many rows as ``input_ids``, or a row tensor or host list
            does not have ``batch_size`` entries (the message names the field).
    """

    TOKEN_TENSORS: ClassVar[tuple[str, ...]] = ("input_ids", "positions", "out_cache_loc")
    """Device tensors with one entry per token, [T]."""
    ROW_TENSORS: ClassVar[tuple[str, ...]] = ("req_pool_indices", "seq_lens", "sample_indices")
    """Device tensors with one entry per request, [bs]."""
    ROW_LISTS: ClassVar[tuple[str, ...]] = ("req_pool_indices_cpu", "seq_lens_cpu", "prefix_lens_cpu",
                                            "extend_lens_cpu")
    """Host lists with one entry per request (``bs``)."""
    OPTIONAL_TOKEN_TENSORS: ClassVar[tuple[str, ...]] = ("padding_mask",)
    """Device tensors with one entry per token, [T], or None."""
    OPTIONAL_ROW_LISTS: ClassVar[tuple[str, ...]] = ("draft_lens_cpu",)
    """Host lists with one entry per request, or None (verify steps only: never in a decode graph)."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    sample_indices: torch.Tensor
    req_pool_indices_cpu: list[int]
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    sampling: SamplingBatchInfo | None
    attn_backend: Any = None
    use_tbo: bool = False
    graph_bs: int | None = None
    tbo_children: list[ForwardBatch] | None = None
    tbo_parent_token_range: tuple[int, int] | None = None
    dispatch_capacity: int | None = None
    padding_mask: torch.Tensor | None = None
    kv_stream: Any = None
    draft_lens_cpu: list[int] | None = None

    def __post_init__(self) -> None:
        num_tokens = self.num_tokens
        for name in self.token_tensor_names():
            if getattr(self, name).shape[0] != num_tokens:
                raise ValueError(f"ForwardBatch.{name} has {getattr(self, name).shape[0]} rows, expected {num_tokens}")
        for name in self.ROW_TENSORS + self.ROW_LISTS + tuple(
                n for n in self.OPTIONAL_ROW_LISTS if getattr(self, n) is not None):
            if len(getattr(self, name)) != self.batch_size:
                raise ValueError(f"ForwardBatch.{name} has {len(getattr(self, name))} entries, "
                                 f"expected {self.batch_size}")

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (T)."""
        return int(self.input_ids.shape[0])

    def token_tensor_names(self) -> tuple[str, ...]:
        """The names of this batch's per-token tensors: :attr:`TOKEN_TENSORS` and the optional ones it has."""
        return self.TOKEN_TENSORS + tuple(n for n in self.OPTIONAL_TOKEN_TENSORS if getattr(self, n) is not None)

    def narrow(self, token_range: tuple[int, int], row_range: tuple[int, int], **changes: Any) -> ForwardBatch:
        """A batch over tokens ``[t0, t1)`` and requests ``[s0, s1)`` of this one.

        Token and row tensors (optional ones too, where set) are views (no copy); host lists are sliced; other
        fields are shared, then ``changes`` replaces any field (e.g. a child's own ``seq_lens`` or
        ``attn_backend``).

        Raises:
            ValueError: the result breaks the shape invariants (ranges that do not match, or bad ``changes``).
        """
        (t0, t1), (s0, s1) = token_range, row_range
        sliced: dict[str, Any] = {name: getattr(self, name)[t0:t1] for name in self.token_tensor_names()}
        sliced.update({name: getattr(self, name)[s0:s1] for name in self.ROW_TENSORS + self.ROW_LISTS})
        sliced.update({name: getattr(self, name)[s0:s1] for name in self.OPTIONAL_ROW_LISTS
                       if getattr(self, name) is not None})
        return dataclasses.replace(self, batch_size=s1 - s0, **{**sliced, **changes})

    @classmethod
    def from_worker_batch(cls, b: ModelWorkerBatch, device: torch.device | str,
                          sampling: SamplingInputs | None = None) -> ForwardBatch:
        """Tensorize ``b`` (copies to ``device`` without a host sync, ``raymoe.step.host_transfer``); positions
        are ``[prefix_len, seq_len)`` per request. ``sampling``: the step's sampling record (the rank's
        ``SamplingTable.resolve``), default ``b.sampling``.

        Raises:
            ValueError: a batch with requests and no sampling record.
        """
        sampling = b.sampling if sampling is None else sampling
        if b.batch_size and sampling is None:
            raise ValueError("a ModelWorkerBatch with requests needs a sampling record (SamplingTable.resolve)")
        def t(x: list[int]) -> torch.Tensor:
            return to_device(x, torch.int64, device)

        seq_lens = t(b.seq_lens)
        if b.forward_mode.is_decode():
            positions = seq_lens - 1
            sample_indices = torch.arange(b.batch_size, device=device)
        else:
            pos: list[int] = []
            last: list[int] = []
            for pre, sl in zip(b.prefix_lens, b.seq_lens, strict=True):
                pos.extend(range(pre, sl))
                last.append(len(pos) - 1)
            positions = t(pos)
            sample_indices = t(last)
        return cls(
            forward_mode=b.forward_mode, batch_size=b.batch_size, input_ids=t(b.input_ids), positions=positions,
            req_pool_indices=t(b.req_pool_indices), seq_lens=seq_lens, out_cache_loc=t(b.out_cache_loc),
            sample_indices=sample_indices, req_pool_indices_cpu=list(b.req_pool_indices),
            seq_lens_cpu=list(b.seq_lens), prefix_lens_cpu=list(b.prefix_lens),
            extend_lens_cpu=list(b.extend_lens),
            sampling=SamplingBatchInfo.from_inputs(sampling, device) if b.batch_size else None,
            use_tbo=b.use_tbo, graph_bs=b.graph_bs, dispatch_capacity=b.dispatch_capacity,
            draft_lens_cpu=list(b.draft_lens) if any(b.draft_lens) else (
                [e - 1 for e in b.extend_lens] if b.forward_mode.is_target_verify() else None),
        )
