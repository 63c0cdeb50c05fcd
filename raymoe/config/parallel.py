"""Parallel layout, MoE overlap and MoE token exchange: options every rank shares."""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: ``world = dp_size * tp_size`` ranks.

    Attributes:
        tp_size: tensor-parallel ranks of attention/dense layers inside one DP-attention group.
        dp_size: DP-attention groups (each schedules its own requests; idle groups run IDLE batches).
        ep_size: expert-parallel ranks: the world size (experts sharded over every rank) or 1 (experts
            tensor-parallel inside each TP group).
        bundle_gpus: reserve one GPU per rank in its placement bundle (None: exactly when the ranks compute on
            CUDA). True with ``device="cpu"`` places ranks as on a GPU cluster while they compute on CPU, which is
            how a cluster of emulated GPU nodes (``ray.cluster_utils.Cluster`` with ``num_gpus``) is tested.
    """

    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    bundle_gpus: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidRequestError(name, f"must be a positive integer, got {v!r}")
        if self.ep_size not in (1, self.world_size):
            raise InvalidRequestError("ep_size", f"must be 1 or the world size dp*tp={self.world_size}, "
                                                 f"got {self.ep_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size


@dataclass(frozen=True)
class OverlapConfig:
    """Compute/communication overlap of MoE layers (DESIGN section 4); every rank must use the same values.

    Attributes:
        enable_tbo: two-batch overlap; the driver decides per step whether it runs (``raymoe.overlap.decision``).
        tbo_min_tokens_decode: a DECODE step runs TBO only if its busiest DP group has at least this many tokens.
        tbo_min_tokens_extend: the same for EXTEND steps.
        tbo_token_distribution_threshold: an EXTEND split whose left token share lies outside
            ``[threshold, 1 - threshold]`` is replaced by the two-chunk split (one sequence cut across both halves).
        enable_sbo: single-batch overlap inside each MoE layer; mutually exclusive with ``enable_tbo``.
        tbo_decode_schedule: stage boundaries of a DECODE TBO step (``raymoe.overlap.strategy``): ``"fine"``
            (SGLang's five stages per MoE layer, child B two stages behind), ``"coarse"`` (the prefill schedule's
            three stages, children in step: each transfer overlaps a whole attention or expert stage of the other
            child), or ``"auto"``: coarse on CPU, fine on CUDA.
    """

    enable_tbo: bool = False
    tbo_min_tokens_decode: int = 16
    tbo_min_tokens_extend: int = 128
    tbo_token_distribution_threshold: float = 0.48
    enable_sbo: bool = False
    tbo_decode_schedule: str = "auto"

    def __post_init__(self) -> None:
        if self.enable_tbo and self.enable_sbo:
            raise InvalidRequestError("enable_sbo", "two-batch and single-batch overlap are mutually exclusive")
        for name in ("tbo_min_tokens_decode", "tbo_min_tokens_extend"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidRequestError(name, f"must be a positive integer, got {v!r}")
        if not 0.0 <= self.tbo_token_distribution_threshold <= 0.5:
            raise InvalidRequestError("tbo_token_distribution_threshold",
                                      f"must be in [0, 0.5], got {self.tbo_token_distribution_threshold!r}")
        if self.tbo_decode_schedule not in ("auto", "fine", "coarse"):
            raise InvalidRequestError("tbo_decode_schedule",
                                      f"must be auto, fine or coarse, got {self.tbo_decode_schedule!r}")


CPU_COMM_MODES = ("auto", "shm", "gloo")


@dataclass(frozen=True)
class MoeCommConfig:
    """How MoE layers move tokens between expert-parallel ranks (``raymoe.comm.dispatcher``); same on every rank.

    Attributes:
        a2a_backend: ``"torch"`` (``torch.distributed`` all-to-all: gloo on CPU, NCCL on GPU) or ``"deepep"``
            (DeepEP buffers; CUDA and the ``deep_ep`` package, checked here).
        a2a_mode: ``"normal"`` (data-dependent shapes, one host sync per layer for the row counts),
            ``"low_latency"`` (fixed shapes, counts stay on the device: capturable in decode graphs) or ``"auto"``
            (low-latency for decode steps, normal for steps with extend tokens; the driver resolves it per step,
            once for all ranks, ``raymoe.comm.a2a_plan``; on a single CPU rank, where nothing is dispatched,
            ``auto`` means normal: ``raymoe.comm.expert_input.effective_a2a_mode``).
        num_max_dispatch_tokens_per_rank: most tokens one rank may send in a low-latency step (sizes DeepEP's
            buffers); a step with more tokens on some rank runs in normal mode. None: ``max_running_requests``.
        cpu_comm: what carries the ``torch`` backend's all-to-all between CPU (gloo) ranks: ``"auto"`` (a
            shared-memory mapping when every EP rank is on one x86-64 node, ``raymoe.comm.shm``; else gloo),
            ``"shm"`` (shared memory or an error at start-up) or ``"gloo"``. Ignored on GPU.
    """

    a2a_backend: str = "torch"
    a2a_mode: str = "auto"
    num_max_dispatch_tokens_per_rank: int | None = None
    cpu_comm: str = "auto"

    def __post_init__(self) -> None:
        from raymoe.comm.expert_input import A2A_BACKENDS, A2A_MODES

        if self.a2a_backend not in A2A_BACKENDS:
            raise InvalidRequestError("a2a_backend", f"must be one of {A2A_BACKENDS}, got {self.a2a_backend!r}")
        if self.a2a_mode not in A2A_MODES:
            raise InvalidRequestError("a2a_mode", f"must be one of {A2A_MODES}, got {self.a2a_mode!r}")
        if self.cpu_comm not in CPU_COMM_MODES:
            raise InvalidRequestError("cpu_comm", f"must be one of {CPU_COMM_MODES}, got {self.cpu_comm!r}")
        m = self.num_max_dispatch_tokens_per_rank
        if m is not None and (not isinstance(m, int) or m < 1):
            raise InvalidRequestError("num_max_dispatch_tokens_per_rank", f"must be a positive integer, got {m!r}")
