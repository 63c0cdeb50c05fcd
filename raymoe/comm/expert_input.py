"""What a dispatch hands the local experts: the layouts of received routing pairs.

* :class:`ExpertRows` (normal mode): one row per received (token, k) pair, ``x`` [R, H] with its local expert id
  ``local_ids`` [R]; R depends on the routing, so shapes are data-dependent.
* :class:`MaskedExpertRows` (DeepEP's low-latency layout, ``low_latency_dispatch``): ``x`` [E_local, C, H]
  with ``C = num_max_dispatch_tokens_per_rank * ep_size``; rows ``[0, counts[e])`` of expert ``e`` are valid and
  the rest hold arbitrary values. Shapes depend only on the step's per-rank capacity, and ``counts`` stays on the
  device, so a decode graph can capture it.
* :class:`GroupedExpertRows` (the torch low-latency dispatcher's layout): the same pairs packed expert after
  expert into ``x`` [R_max, H], ``R_max`` the most rows a rank can receive; segment ends stay on the device.
  Fixed shapes as well, and one grouped GEMM per projection runs over the valid rows only, where the masked
  layout's batched GEMM computes every one of the ``E_local * C`` slots.
* :class:`RoutedTokenRows` (the torch low-latency dispatcher's layout for small steps on CPU, and the ep=1 dense
  path): every received token row once, in blocks (one per source rank: its message, read in place), with the
  token's own top-k ids and weights. The experts answer the weighted sum of this rank's picks per row: the fused
  CPU kernel computes only the routed (row, expert) pairs; the torch path converts it to
* :class:`DenseExpertRows`: the same rows as ``x`` [R, H] with a routing weight per local expert, ``weights``
  [R, E_local] (0 where the token did not pick it); every local expert runs over every row in two batched GEMMs.
  Where the rows are few (a decode step of a small model on CPU) either costs less than sorting the pairs and
  running grouped GEMMs over segments of one or two rows.

Each layout computes itself through the matching operation of :class:`ExpertCompute` (``rows.compute(ops,
experts)``), which the rank's platform implements; the experts answer in the layout they were given, and the
dispatcher's combine takes that answer back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

A2A_MODES: tuple[str, ...] = ("normal", "low_latency", "auto")
NO_EXPERT = -1
"""The top-k id of a pair that goes to no expert (DeepEP's convention): the MoE layer gives it to every pair of a
decode graph's padding rows (with weight 0), and no dispatch sends or computes such a pair."""
A2A_BACKENDS: tuple[str, ...] = ("torch", "deepep")


class ExpertWeights(Protocol):
    """A rank's local experts as the expert operations read them (``raymoe.layers.moe.LocalExperts``).

    Attributes:
        w13: [E_local, 2 I, H] gate and up projections. w2: [E_local, H, I] down projections.
        prepared13, prepared2: what the platform's ``prepare_weight`` made of them at load (None: nothing).
        num_local: E_local. expert_start: the global id of local expert 0.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    prepared13: Any
    prepared2: Any
    num_local: int
    expert_start: int


class ExpertCompute(ABC):
    """The expert operations (SwiGLU experts, Shazeer 2020), one per layout; part of the platform interface
    (``raymoe.platform.interface.Platform``). Outputs have the input rows' dtype."""

    @abstractmethod
    def expert_rows(self, x: torch.Tensor, local_ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """Expert ``local_ids[i]`` on row ``x[i]``: ``x`` [R, H], ``local_ids`` [R] int64 -> [R, H] (R may be 0). A
        row whose id is :data:`NO_EXPERT` is multiplied by no expert and answers 0."""

    @abstractmethod
    def expert_segments(self, x: torch.Tensor, ends: torch.Tensor, expert_capacity: int,
                        experts: ExpertWeights) -> torch.Tensor:
        """Expert ``e`` on rows ``[ends[e - 1], ends[e])`` of ``x`` [R_max, H] (``ends`` [E_local] int32 on the
        device; no expert has more than ``expert_capacity`` rows) -> [R_max, H]; rows from ``ends[-1]`` on are
        padding in and out. Must not read device values on the host (decode graphs hold it)."""

    @abstractmethod
    def expert_masked(self, rows: MaskedExpertRows, experts: ExpertWeights) -> torch.Tensor:
        """The valid rows of the masked layout through their expert: ``rows.x`` [E_local, C, H] -> [E_local, C, H];
        slots past ``rows.counts[e]`` hold anything in and out. Must not read ``counts`` on the host (decode graphs
        hold it)."""

    @abstractmethod
    def expert_dense(self, x: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
        """``sum_e weights[:, e] * expert_e(x)``: ``x`` [R, H], ``weights`` [R, E_local] -> [R, H]."""

    @abstractmethod
    def expert_routed(self, rows: RoutedTokenRows, experts: ExpertWeights) -> torch.Tensor:
        """Token rows with their own routing (:class:`RoutedTokenRows`) -> the weighted sums of this rank's picks
        per row, [B * M, H]."""


@dataclass
class ExpertRows:
    """Received pairs, one row each: ``x`` [R, H] (hidden dtype), ``local_ids`` [R] int64 in ``[0, E_local)``, or
    :data:`NO_EXPERT` for a pair nobody computes (its answer row is 0: at ``ep == 1`` the normal mode hands the
    experts every pair of the step, a graph's padding rows' too)."""

    x: torch.Tensor
    local_ids: torch.Tensor

    def compute(self, ops: ExpertCompute, experts: ExpertWeights) -> torch.Tensor:
        """The experts' answer [R, H]."""
        return ops.expert_rows(self.x, self.local_ids, experts)


@dataclass
class MaskedExpertRows:
    """Received pairs packed per local expert: ``x`` [E_local, C, H], ``counts`` [E_local] int32 valid rows each
    (on the device), ``max_rows`` the most valid rows all experts together can hold in this step (a host bound,
    ``min(ep * M * min(k, E_local), E_local * C)`` for a step of per-rank capacity M and top-k k: each of the
    ``ep * M`` tokens sends at most one row to each of its distinct experts here). ``x_scale``: set when the
    dispatch moved FP8 rows (DeepEP's ``use_fp8``): ``x`` is then ``float8_e4m3fn`` and row ``[e, c]`` is worth
    ``x[e, c, j] * x_scale[e, c, j // 128]`` (float32 [E_local, C, H / 128], any strides)."""

    x: torch.Tensor
    counts: torch.Tensor
    max_rows: int
    x_scale: torch.Tensor | None = None

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> MaskedExpertRows:
        """These rows with ``x`` in ``dtype`` (FP8 rows times their scales; itself where ``x_scale`` is None)."""
        if self.x_scale is None:
            return self
        h = self.x.shape[-1]
        x = self.x.float() * self.x_scale.repeat_interleave(128, dim=-1)[..., :h]
        return MaskedExpertRows(x.to(dtype), self.counts, self.max_rows)

    def compute(self, ops: ExpertCompute, experts: ExpertWeights) -> torch.Tensor:
        """The experts' answer [E_local, C, H] (slots past ``counts[e]`` hold anything)."""
        return ops.expert_masked(self, experts)


@dataclass
class GroupedExpertRows:
    """Received pairs in expert order, fixed shape: ``x`` [R_max, H] (hidden dtype); local expert ``e``'s rows
    are ``[ends[e - 1], ends[e])`` (``ends`` [E_local] int32 cumulative row counts, on the device; expert 0
    starts at row 0). Rows from ``ends[E_local - 1]`` on are padding with arbitrary values (possibly never
    written), and the experts' answer may hold anything there too. ``expert_capacity``: the most rows one expert
    can get (``ep * M``), which sizes the masked layout where grouped GEMMs are unavailable."""

    x: torch.Tensor
    ends: torch.Tensor
    expert_capacity: int

    def compute(self, ops: ExpertCompute, experts: ExpertWeights) -> torch.Tensor:
        """The experts' answer [R_max, H] (padding rows hold anything)."""
        return ops.expert_segments(self.x, self.ends, self.expert_capacity, experts)


@dataclass
class DenseExpertRows:
    """Received token rows for every local expert: ``x`` [R, H] (hidden dtype), ``weights`` [R, E_local] (hidden
    dtype) the routing weight of row r for local expert e, 0 where r did not pick e. Rows that carry no token
    (padding) have all-zero weights and arbitrary values (possibly never written), and the experts' answer may
    hold anything there. The experts answer ``sum_e weights[r, e] * expert_e(x[r])`` as [R, H]."""

    x: torch.Tensor
    weights: torch.Tensor

    def compute(self, ops: ExpertCompute, experts: ExpertWeights) -> torch.Tensor:
        """The weighted sums [R, H]."""
        return ops.expert_dense(self.x, self.weights, experts)


def resolve_a2a_mode(mode: str, is_decode_step: bool) -> str:
    """The concrete mode (``"normal"`` or ``"low_latency"``) of a step under engine option ``mode``.

    ``auto`` means low-latency for decode steps (DECODE and IDLE groups only) and normal for steps with extend
    tokens, as SGLang's DeepEP ``auto`` mode does.

    Raises:
        ValueError: ``mode`` is not one of :data:`A2A_MODES`.
    """
    if mode not in A2A_MODES:
        raise ValueError(f"a2a_mode must be one of {A2A_MODES}, got {mode!r}")
    if mode == "auto":
        return "low_latency" if is_decode_step else "normal"
    return mode


@dataclass
class RoutedTokenRows:
    """Token rows with their own routing, in blocks: ``x`` [B, M, H] (hidden dtype), ``topk_ids`` [B, M, k] int64
    global expert ids, ``topk_weights`` [B, M, k] (hidden dtype); any strides with a unit last one (the dispatcher
    hands out views of the received messages). This rank owns experts ``[first_expert, first_expert + E_local)``;
    pairs with other ids (another rank's expert, or ``E`` on a padding row, whose ``x`` and weights may hold
    anything) are not its. The experts answer ``sum over this rank's picks j of topk_weights[b, m, j] *
    expert(x[b, m])`` per row, as [B * M, H] (row ``b * M + m``)."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    first_expert: int

    def compute(self, ops: ExpertCompute, experts: ExpertWeights) -> torch.Tensor:
        """The weighted sums of this rank's picks [B * M, H]."""
        return ops.expert_routed(self, experts)

    def dense(self, num_local: int) -> DenseExpertRows:
        """The same rows as :class:`DenseExpertRows` ([B * M, H], a weight per local expert; pairs that are not
        this rank's are selected away, never multiplied, so garbage in padding rows stays out of the weights)."""
        b, m, h = self.x.shape
        k = self.topk_ids.shape[-1]
        local = self.topk_ids.reshape(b * m, k) - self.first_expert
        mine = (local >= 0) & (local < num_local)
        weights = torch.zeros(b * m, num_local + 1, dtype=self.topk_weights.dtype, device=self.x.device)
        weights.scatter_add_(1, torch.where(mine, local, num_local),
                             torch.where(mine, self.topk_weights.reshape(b * m, k), 0.0))
        return DenseExpertRows(self.x.reshape(b * m, h), weights[:, :num_local])


ExpertInput = ExpertRows | MaskedExpertRows | GroupedExpertRows | DenseExpertRows | RoutedTokenRows
"""Every layout a dispatch may hand the experts; each has ``compute(ops, experts)``."""
