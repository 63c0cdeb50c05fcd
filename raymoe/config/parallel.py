"""Parallel layout, MoE overlap and MoE token exchange: options every rank shares (declarations:
``raymoe.config.option``)."""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.comm.expert_input import A2A_BACKENDS, A2A_MODES
from raymoe.config.option import check_choices, option
from raymoe.errors import InvalidRequestError

CPU_COMM_MODES = ("auto", "shm", "gloo")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: ``world = dp_size * tp_size`` ranks; each field's help says what it means.

    Raises:
        InvalidRequestError: a size that is not a positive integer, or ``ep_size`` neither 1 nor the world size.
    """

    tp_size: int = option(1, flag="tp", help="tensor-parallel ranks of attention and dense layers inside one "
                                             "DP-attention group (world size > 1 runs the ranks as Ray actors).")
    dp_size: int = option(1, flag="dp", help="DP-attention groups (each schedules its own requests; idle groups run "
                                             "IDLE batches).")
    ep_size: int = option(1, flag="ep", help="expert-parallel ranks: the world size dp*tp (experts sharded over every "
                                             "rank) or 1 (experts tensor-parallel inside each TP group).")
    bundle_gpus: bool | None = option(
        None, help="reserve one GPU per rank in its placement bundle (None: exactly when the ranks compute on CUDA, "
                   "decided with the device). "
                   "True with device cpu places ranks as on a GPU cluster while they compute on CPU (how a cluster "
                   "of emulated GPU nodes is tested).")

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

    Raises:
        InvalidRequestError: both overlaps on, a threshold out of range or a schedule not among its choices.
    """

    enable_tbo: bool | None = option(
        None, help="two-batch overlap of MoE layers; the driver decides per step whether it runs "
                   "(raymoe.overlap.decision). None: on exactly when experts are sharded (ep_size > 1) over CUDA "
                   "ranks without enable_sbo, decided with the device (raymoe.config.device_defaults); off on CPU "
                   "ranks, where the shared-memory all-to-all leaves no latency to hide. A config that was never "
                   "resolved reads None as off.")
    tbo_min_tokens_decode: int = option(
        16, help="a DECODE step runs two-batch overlap only if its busiest DP group has at least this many tokens.")
    tbo_min_tokens_extend: int = option(128, help="the same bound for EXTEND steps, tokens.")
    tbo_token_distribution_threshold: float = option(
        0.48, help="an EXTEND split whose left token share lies outside [threshold, 1 - threshold] is replaced by "
                   "the two-chunk split (one sequence cut across both halves); in [0, 0.5].")
    enable_sbo: bool = option(
        False, help="single-batch overlap inside each MoE layer; mutually exclusive with enable_tbo.")
    tbo_decode_schedule: str = option(
        "auto", choices=("auto", "fine", "coarse"),
        help="stage boundaries of a DECODE two-batch-overlap step (raymoe.overlap.strategy): fine (SGLang's five "
             "stages per MoE layer, child B two stages behind), coarse (the prefill schedule's three stages, "
             "children in step: each transfer overlaps a whole attention or expert stage of the other child) or "
             "auto: coarse on CPU, fine on CUDA.")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.enable_tbo and self.enable_sbo:
            raise InvalidRequestError("enable_sbo", "two-batch and single-batch overlap are mutually exclusive")
        for name in ("tbo_min_tokens_decode", "tbo_min_tokens_extend"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidRequestError(name, f"must be a positive integer, got {v!r}")
        if not 0.0 <= self.tbo_token_distribution_threshold <= 0.5:
            raise InvalidRequestError("tbo_token_distribution_threshold",
                                      f"must be in [0, 0.5], got {self.tbo_token_distribution_threshold!r}")


@dataclass(frozen=True)
class MoeCommConfig:
    """How MoE layers move tokens between expert-parallel ranks (``raymoe.comm.dispatcher``); same on every rank.

    Raises:
        InvalidRequestError: a value not among its choices, or a dispatch bound that is not a positive integer.
    """

    a2a_backend: str = option(
        "torch", choices=A2A_BACKENDS,
        help="MoE all-to-all backend: torch (torch.distributed all-to-all: gloo on CPU, NCCL on GPU) or deepep "
             "(DeepEP buffers; needs CUDA and the deep_ep package, checked when the engine is configured).")
    a2a_mode: str = option(
        "auto", choices=A2A_MODES,
        help="MoE all-to-all mode: normal (data-dependent shapes, one host sync per layer for the row counts), "
             "low_latency (fixed shapes, counts stay on the device: capturable in decode graphs) or auto "
             "(low-latency for decode steps, normal for steps with extend tokens, resolved by the driver per step "
             "for all ranks, raymoe.comm.a2a_plan; on a single CPU rank, where nothing is dispatched, auto means "
             "normal).")
    num_max_dispatch_tokens_per_rank: int | None = option(
        None, help="most tokens one rank may send in a low-latency step (sizes DeepEP's buffers); a step with more "
                   "tokens on some rank runs in normal mode. None: max_running_requests.")
    cpu_comm: str = option(
        "auto", choices=CPU_COMM_MODES,
        help="what carries the torch backend's all-to-all between CPU (gloo) ranks: auto (a shared-memory mapping "
             "when every EP rank is on one x86-64 node, raymoe.platform.cpu.shm; else gloo), shm (shared memory or "
             "an error at start-up) or gloo. Ignored on GPU.")

    def __post_init__(self) -> None:
        check_choices(self)
        m = self.num_max_dispatch_tokens_per_rank
        if m is not None and (not isinstance(m, int) or m < 1):
            raise InvalidRequestError("num_max_dispatch_tokens_per_rank", f"must be a positive integer, got {m!r}")
