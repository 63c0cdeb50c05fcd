"""The platform interface: every operation layers, models, attention and communication ask of the machine they run
on, behind one typed object per rank.

A layer calls ``self.ops.rms_norm(...)``; it never asks which device it is on or whether a kernel library loaded.
The implementations (``raymoe.platform.reference``: torch operators on any device and dtype; ``raymoe.platform.cpu``:
the C kernels, packed weights, the shared-memory exchange, process tuning; ``raymoe.platform.cuda``:
flash-attention, DeepEP, CUDA graphs) are chosen once per rank by ``raymoe.platform.selector.select_platform`` from
the rank's device and dtype, the way vLLM's ``vllm/platforms`` and its CustomOp ``forward_native`` /
``forward_cuda`` / ``forward_cpu`` split work. A platform that cannot take a call's tensors (a dtype its kernel
lacks, a tensor on another device) runs the reference operation for that call: results never depend on which
implementation ran beyond floating-point rounding.

So a CPU-only speed change touches only ``raymoe/platform/cpu``, and a GPU kernel only ``raymoe/platform/cuda``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Protocol

import torch

from raymoe.attention.base import AttentionBackend
from raymoe.comm.dispatcher import A2ABackendSpec, MoeDispatcher
from raymoe.comm.expert_input import ExpertCompute
from raymoe.comm.groups import ParallelGroups
from raymoe.comm.low_latency import LowLatencyOps
from raymoe.comm.transport import EpTransport
from raymoe.overlap.fusion import Fusion
from raymoe.overlap.streams import TboStreams


class WeightKind(Enum):
    """How a layer uses a weight, which decides what a platform prepares for it at load time."""

    LINEAR = "linear"      # [N, K]: ``x @ W^T`` (projections, the router gate)
    LM_HEAD = "lm_head"    # [V_local, H]: the LM head, read once per step
    EXPERTS = "experts"    # [E_local, N, K]: stacked expert projections (grouped GEMMs)


@dataclass(frozen=True)
class BlockScales:
    """The scales of an FP8 weight (``float8_e4m3fn`` ``[..., N, K]``; ``raymoe.config_quant``): weight ``[i, j]``
    is worth ``fp8[i, j] * scale[i // bn, j // bk]``, partial edge blocks included (DeepSeek's ``weight_dequant``).

    Attributes:
        scale: float32 ``[..., ceil(N / bn), ceil(K / bk)]`` (leading dims as the weight's: experts).
        block: ``(bn, bk)``; per-channel and per-tensor checkpoints load as ``(1, K)`` blocks, one scale per row.
    """

    scale: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"block must be two positive sizes, got {self.block}")
        if self.scale.dtype != torch.float32 or self.scale.dim() < 2:
            raise ValueError(f"scale must be float32 [..., rows, cols], got {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether the scale grid covers ``weight`` [..., N, K] exactly (``ceil(N / bn)`` x ``ceil(K / bk)``)."""
        n, k = weight.shape[-2:]
        bn, bk = self.block
        grid = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
        return tuple(self.scale.shape) == grid


class Rotary(Protocol):
    """A rotary embedding (``raymoe.layers.rotary.RotaryEmbedding``): float32 ``cos``/``sin`` tables [P, D] and
    ``rotate(positions [T] int64, x [T, H, D]) -> [T, H, D]``; ``interleaved``: pairs are adjacent channels
    (DeepSeek) rather than the two halves (neox)."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


class HostCopy(Protocol):
    """Tensors on their way from the rank's device to the host (:meth:`Platform.copy_to_host`).

    Attributes:
        tensors: host tensors, one per source tensor in the same order; their values are valid once
            :meth:`wait` returned (or :meth:`ready` said True).
    """

    tensors: list[torch.Tensor]

    def ready(self) -> bool:
        """Whether the copies are complete (never blocks)."""

    def wait(self) -> None:
        """Block until the copies are complete (a host sync with the work queued before the copy, and only it)."""


GraphOutput = torch.Tensor | tuple[torch.Tensor, ...]
"""What a captured forward returns: one tensor, or a tuple of them (e.g. logits and the final hidden states a draft
model reads), each with the bucket's rows first."""


class GraphStep(Protocol):
    """One captured decode-graph bucket; :meth:`replay` runs it and returns what the captured forward returned
    (:data:`GraphOutput`: its logits [bs, V] float32, possibly with more outputs)."""

    def replay(self) -> GraphOutput: ...


class GraphCapture(Protocol):
    """How a platform captures decode graphs (``raymoe.runner.graph_runner``).

    Attributes:
        fixed_kv_width: each graph attends over the KV width it was captured at (CUDA graphs freeze shapes), so a
            bucket is captured per width of a ladder; False: a replay narrows to the step's longest sequence.
        binds_addresses: a replay reads the tensors the capture read at their addresses (CUDA graphs), so a
            weight whose prepared form is made anew (a weight update, ``raymoe.runner.weight_reload``) needs a new
            capture; False: a replay runs the forward again and reads what the layers hold then.
    """

    fixed_kv_width: bool
    binds_addresses: bool

    def capture(self, run: Callable[[], GraphOutput], bs: int, max_bs: int, host_sync_free: bool) -> GraphStep:
        """Capture ``run`` (one bucket's forward, ``bs`` rows; ``max_bs`` the largest bucket; it returns the same
        number of tensors on every call, each with ``bs`` rows first). ``host_sync_free``:
        the forward must not read device values on the host (a CUDA graph cannot hold such a read; a CPU
        recording proves the forward free of them under ``raymoe.platform.reference.sync_guard.HostSyncGuard``).

        Raises:
            RuntimeError: the capture failed (its message says how to avoid it).
        """

    def finish(self) -> None:
        """Called once after the last capture (CUDA: waits for the device)."""


@dataclass(frozen=True)
class BackendRegistry:
    """Backends a platform builds by name besides its own: lazy factories of the GPU libraries' adapters, which
    the selector passes in so that a platform never imports another platform's code (they also run on CPU through
    conformance doubles of their libraries in tests).

    Attributes:
        attention: backend name -> ``factory(req_to_token_pool=, token_to_kv_pool=, num_heads=, num_kv_heads=,
            head_dim=[, windows=, sinks=])`` for grouped-query attention.
        dispatchers: backend name -> ``factory(groups, num_experts, spec, hidden_size, dtype)``.
        mla_attention: backend name -> ``factory(req_to_token_pool=, token_to_kv_pool=, num_heads=,
            softmax_scale=)`` for multi-head latent attention over the latent cache.
    """

    attention: Mapping[str, Callable[..., AttentionBackend]] = field(default_factory=dict)
    dispatchers: Mapping[str, Callable[..., MoeDispatcher]] = field(default_factory=dict)
    mla_attention: Mapping[str, Callable[..., AttentionBackend]] = field(default_factory=dict)


class Platform(ExpertCompute, LowLatencyOps, ABC):
    """The operations of one rank's machine. Shapes and dtypes are per method; every operation accepts the
    tensors of its reference implementation (``raymoe.platform.reference``) and returns the same values up to
    floating-point rounding. The expert operations are declared beside the layouts they compute
    (:class:`~raymoe.comm.expert_input.ExpertCompute`), the expert layout and message writes beside the exchange
    that asks for them (:class:`~raymoe.comm.low_latency.LowLatencyOps`).

    Attributes:
        name: ``"torch"``, ``"cpu"`` or ``"cuda"``.
        default_tbo_decode_schedule: the DECODE two-batch-overlap schedule ``tbo_decode_schedule="auto"`` means
            here (``raymoe.overlap.strategy``): ``"coarse"`` where a half-batch stage takes milliseconds (CPU),
            ``"fine"`` (SGLang's five stages) elsewhere.
        fixed_shape_decode: decode graphs freeze every shape (CUDA graphs), so decode steps keep the low-latency
            dispatch's fixed shapes even on one rank.
        async_host_copy: :meth:`copy_to_host` returns before the copy is done (a GPU's queued work), so a rank
            can prepare its next step before it answers this one (``raymoe.actors.step_channel``).
    """

    name: ClassVar[str]
    default_tbo_decode_schedule: ClassVar[str] = "fine"
    fixed_shape_decode: ClassVar[bool] = False
    async_host_copy: ClassVar[bool] = False

    def effective_a2a_mode(self, mode: str, ep_size: int) -> str:
        """The engine-wide MoE all-to-all mode the driver and the ranks use for option ``mode``: ``auto`` becomes
        ``normal`` where nothing is dispatched (``ep_size == 1``) and decode need not keep fixed shapes (no graph
        freezes them): the normal path is then free of host syncs too (grouped GEMMs over only the routed rows),
        while the low-latency layout would compute every expert over every slot. Otherwise ``mode`` as given."""
        if mode == "auto" and ep_size == 1 and not self.fixed_shape_decode:
            return "normal"
        return mode

    # ---- weights ----
    @abstractmethod
    def prepare_weight(self, weight: torch.Tensor, kind: WeightKind, scales: BlockScales | None = None) -> Any:
        """What this platform keeps beside ``weight`` after it is loaded (a packed copy, scales ...), handed back
        to :meth:`linear`, :meth:`weight_values` and the expert operations; None when it keeps nothing. May store
        ``weight`` in another memory layout (same values) where its kernels read that layout faster.

        ``scales``: ``weight`` is ``float8_e4m3fn`` with these block scales (FP8 checkpoints); the weight stays FP8
        in memory and every operation over it dequantizes or multiplies in FP8 as the platform can.

        Raises:
            ValueError: ``scales`` does not cover ``weight`` (:meth:`BlockScales.fits`) or ``weight`` is not FP8.
        """

    def prepare_weight_slots(self, weight: torch.Tensor, kind: WeightKind, prepared: Any, slots: Sequence[int],
                             scales: BlockScales | None = None) -> Any:
        """``prepared`` (what :meth:`prepare_weight` made of the stacked ``weight`` [S, N, K]) brought up to date
        after the slots ``slots`` (indices along dim 0) changed in place, as an expert rebalance does
        (``raymoe.eplb.weight_mover``); returns the prepared object to use from now on. The default prepares the
        whole weight again; a platform whose prepared form is per slot updates only those slots, in place."""
        return self.prepare_weight(weight, kind, scales)

    @abstractmethod
    def weight_values(self, weight: torch.Tensor, prepared: Any, dtype: torch.dtype) -> torch.Tensor:
        """The values of a loaded weight in ``dtype`` (``weight`` itself, cast, where it is not FP8; dequantized
        with its :class:`BlockScales` where it is), for layers that use a weight other than through
        :meth:`linear` (MLA's absorbed ``W_UK`` / ``W_UV``)."""

    # ---- dense operations ----
    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, prepared: Any,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight^T (+ bias)``: ``x`` [..., K], ``weight`` [N, K] -> [..., N] in ``x``'s dtype;
        ``prepared`` from :meth:`prepare_weight` (or None). An FP8 ``weight`` (``prepared`` holds its scales)
        counts as its dequantized values: CPU platforms dequantize it to ``x``'s dtype (weight-only), CUDA
        multiplies in FP8 with per-token-group activation scales."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU gate (Shazeer 2020): ``silu(x[..., :d]) * x[..., d:]`` for ``x`` [..., 2d] -> [..., d]."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm (Zhang & Sennrich 2019) over the last dim, computed in float32 and cast back before the weight
        multiplies (Hugging Face's order): ``x`` [..., D], ``weight`` [D] (or [heads, D] for a [T, heads, D]
        input) -> ``x``'s shape and dtype."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``: the pre-norm residual step; ``x``, ``residual`` [T, D],
        ``weight`` [D]."""

    @abstractmethod
    def qk_norm_rope(self, qk: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                     rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm (when ``norm_weight`` [H, D] is given) then rotary embedding of ``qk`` [T, H, D] (queries
        and keys side by side) at ``positions`` [T] int64; returns the result ([T, H, D], possibly ``qk`` itself
        written in place)."""

    @abstractmethod
    def topk_softmax(self, logits: torch.Tensor, top_k: int, renormalize: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax routing with greedy top-k (Qwen3-MoE, Mixtral, DeepSeek-V2 ``greedy``): ``logits`` [T, E] ->
        ``(weights, ids)``, float32 and int64 [T, top_k]: the ``top_k`` most probable experts per token (ties to
        the lower id), their probabilities (renormalized to sum 1 when ``renormalize``) times ``scale``."""

    # ---- sampling ----
    @abstractmethod
    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The first maximum of each row: ``logits`` [bs, V] float -> [bs] int64 (``torch.argmax``, ties included)."""

    @abstractmethod
    def sample_rows(self, logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """One token per row without candidate filters: a row with temperature 0 takes its first maximum, any other
        the inverse CDF of ``softmax(logits / t)`` at ``uniforms[b]`` (the first token whose running weight exceeds
        ``uniforms[b]`` times the total). ``logits`` [bs, V] float32; ``temperatures``, ``uniforms`` [bs] float32
        -> [bs] int64."""

    @abstractmethod
    def sample_filtered(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                        top_ps: torch.Tensor, min_ps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """:meth:`sample_rows` among each row's candidates only: its ``top_ks`` most probable tokens (0: no
        limit; 1: greedy), the smallest prefix whose mass reaches ``top_ps`` (top-p, Holtzman et al. 2020) and
        those above ``min_ps`` times the most probable one's probability (min-p, Nguyen et al. 2024). ``top_ks``
        int64, ``top_ps``, ``min_ps`` float32 [bs]."""

    @abstractmethod
    def apply_penalties(self, x: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None, rows: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> None:
        """Penalties in place on ``x`` [n, V] float32 (``raymoe.runner.penalties``): row i reads the token counts
        ``counts[rows[i]]`` ([R, V] float32) and, where ``seen`` ([R, V] bool) is given, the prompt marks
        ``seen[rows[i]]``; where a token was seen (marked or counted) and ``repetition[i] != 1``, ``x / rep`` if
        ``x > 0`` else ``x * rep`` (HF's repetition penalty), then ``x -= frequency[i] * c + presence[i] * (c > 0)``
        (OpenAI's). ``rows`` [n] int64; ``presence``, ``frequency``, ``repetition`` [n] float32."""

    @abstractmethod
    def sampling_probs(self, logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                       top_ps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
        """The distribution :meth:`sample_filtered` draws from, unnormalized: ``softmax(logits / t)`` with every
        token outside a row's candidates set to 0 (rows with temperature 0 or top-k 1 get their rows computed at
        temperature 1; callers treat them as greedy). ``logits`` [N, V] float32, the others [N] -> [N, V] float32.
        Speculative decoding's rejection sampling compares draft tokens against it (``raymoe.runner.spec_verify``)."""

    # ---- attention ----
    @abstractmethod
    def attention_backend(self, name: str, **kwargs: Any) -> AttentionBackend:
        """Grouped-query attention backend ``name`` (keyword arguments: ``req_to_token_pool``,
        ``token_to_kv_pool``, ``num_heads``, ``num_kv_heads``, ``head_dim``; for models with attention sinks or
        sliding windows also ``windows`` (per layer: tokens or None) and ``sinks`` (per layer: [num_heads] logits or
        None), which ``torch_native`` serves with ``raymoe.attention.sink_window.SinkWindowAttnBackend``).

        Raises:
            ValueError: an unknown name.
        """

    @abstractmethod
    def mla_attention_backend(self, name: str, **kwargs: Any) -> AttentionBackend:
        """Multi-head latent attention backend ``name`` (keyword arguments: ``req_to_token_pool``,
        ``token_to_kv_pool`` (the latent cache), ``num_heads``, ``softmax_scale``).

        Raises:
            ValueError: ``name`` has no MLA implementation here.
        """

    # ---- communication ----
    @abstractmethod
    def create_ep_transport(self, groups: ParallelGroups, cpu_comm: str, timeout_s: float) -> EpTransport | None:
        """The EP group's transport (collective over ``groups.ep_group``); None: ``torch.distributed`` carries
        every exchange. ``cpu_comm``: ``MoeCommConfig.cpu_comm``."""

    @abstractmethod
    def create_dispatcher(self, spec: A2ABackendSpec, groups: ParallelGroups, num_experts: int, hidden_size: int,
                          dtype: torch.dtype, intermediate_size: int, fp8_experts: bool = False) -> MoeDispatcher:
        """The MoE dispatcher of one layer (``spec.name``: ``"torch"`` or a registered backend such as
        ``"deepep"``) for ``num_experts`` experts of ``hidden_size`` and local ``intermediate_size``;
        ``fp8_experts``: the layer's experts are FP8 with 128 x 128 block scales (a backend may then move FP8
        rows).

        Raises:
            ValueError: an unknown backend name. ImportError: a backend whose package is missing.
        """

    # ---- the step's results and streams ----
    @abstractmethod
    def copy_to_host(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Start copying ``tensors`` (any shapes and dtypes, on the rank's device) to the host, behind the work
        already queued, without blocking the host: a step's sampled ids and log-probs, read when the step is
        answered (``raymoe.runner.step_result``)."""

    def stream_scope(self) -> Hashable:
        """The scope in which a device constant cached for later steps is valid (part of its cache key,
        ``LowLatencyOps.stream_scope``): None where the device has one stream (the default); CUDA answers the
        current stream."""
        return None

    def tbo_streams(self) -> TboStreams | None:
        """The streams a two-batch-overlap forward runs its children on (``raymoe.overlap.streams``), or None to
        run both on the current stream (the default: CPU and the reference have no streams). The model drops
        them for steps whose MoE exchange receives through hooks (``MoeDispatcher.receives_through_hooks``)."""
        return None

    # ---- the forward ----
    def fusions(self) -> Sequence[Fusion]:
        """Fusions this platform applies to plain forwards (no overlap): none by default."""
        return ()

    @abstractmethod
    def graph_capture(self, device: torch.device) -> GraphCapture:
        """A capturer of decode graphs on ``device`` (``raymoe.runner.graph_runner``)."""

    # ---- the rank's process ----
    def set_rank_threads(self, cpu_threads: int | None, ranks_on_node: int) -> None:
        """Set the intra-op threads of a process that hosts one rank (a rank actor, or the driver actor of a
        one-rank world) to :func:`rank_cpu_threads` (``cpu_threads``: ``EngineConfig.cpu_threads``)."""
        torch.set_num_threads(rank_cpu_threads(cpu_threads, ranks_on_node))

    def tune_rank_memory(self) -> None:  # noqa: B027
        """Tune the process's host allocator for a rank's steps (called when its runner is built). Nothing by
        default."""

    def configure_step_thread(self, cpu_rank_nice: int | None, multi_rank: bool) -> None:  # noqa: B027
        """Tune the calling thread, which runs the rank's steps; ``cpu_rank_nice``: ``EngineConfig.cpu_rank_nice``;
        ``multi_rank``: the rank meets peers in collectives every step. Nothing by default."""


def rank_cpu_threads(requested: int | None, ranks_on_node: int) -> int:
    """Intra-op threads for one rank's process: ``requested``, else ``(cores - 1) // ranks_on_node`` and at least 1.

    One core is left to the processes beside the ranks (HTTP front end, driver loop, Ray, a load generator): torch's
    parallel regions wait for their slowest thread, so a rank whose threads share a core with them runs each step
    at the pace of the busiest core (on the 2-core CI machine, serving at 2 threads gave about half the throughput of
    1 thread).
    """
    if requested is not None:
        return requested
    return max(1, ((os.cpu_count() or 1) - 1) // max(1, ranks_on_node))
