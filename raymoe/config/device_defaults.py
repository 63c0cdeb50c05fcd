"""The per-device defaults of an engine, decided once from its device.

``EngineConfig`` keeps ``auto`` / ``None`` for the options whose default depends on where the ranks compute; once
the device is known (``raymoe.cluster.device_choice.resolve_engine_config``, in the process that starts the
engine, before any actor starts) :func:`with_device` writes every one of them into the config, so the driver, the
group processes and the ranks read decided values and none of them looks at its own machine to guess:

=================== ======================================= ============================================
option              CUDA                                    CPU
=================== ======================================= ============================================
dtype auto          bfloat16                                float32
enable_tbo None     on when ep_size > 1 and not enable_sbo  off (the shared-memory exchange hides nothing)
fanout None         compiled (Ray Compiled Graph)           channel (the step channel)
group_schedulers    actors from GROUP_ACTORS_MIN_DP DP      driver
auto                groups of a served multi-rank engine
bundle_gpus None    True (one GPU per rank bundle)          False
=================== ======================================= ============================================

The all-to-all mode's per-device rule (``auto`` on one CPU EP rank is normal) is the platform's
(``Platform.effective_a2a_mode``), applied once per engine where the ranks' config is built
(``raymoe.actors.factory.runner_config_for``).
"""

from __future__ import annotations

import dataclasses

from raymoe.config.engine import GROUP_ACTORS_MIN_DP, EngineConfig

RESOLVED_DEVICES = ("cpu", "cuda")


def with_device(config: EngineConfig, device: str, serving: bool = True) -> EngineConfig:
    """``config`` with ``device`` and every per-device default decided (table above); options given explicitly
    keep their values. The result's ``__post_init__`` checks run again on the decided values (a GPU backend
    on CPU, DeepEP outside bfloat16 ... fail here).

    Args:
        config: the engine's options as given.
        device: ``"cpu"`` or ``"cuda"``, the device every rank computes on.
        serving: the engine serves through a front end (``raymoe serve``, the Serve app), which alone can run DP
            group schedulers in processes of their own; the offline ``Engine`` keeps them in its process.
    Raises:
        ValueError: ``device`` is not a resolved device. InvalidRequestError: a decided value its config refuses.
    """
    if device not in RESOLVED_DEVICES:
        raise ValueError(f"device must be one of {RESOLVED_DEVICES}, got {device!r}")
    cuda = device == "cuda"
    parallel, overlap = config.parallel, config.overlap
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if cuda else "float32")
    tbo = overlap.enable_tbo
    if tbo is None:
        tbo = cuda and parallel.ep_size > 1 and not overlap.enable_sbo
    groups = config.group_schedulers
    if parallel.world_size == 1:
        groups = "driver"  # the one rank computes in the driver's process
    elif groups == "auto":
        groups = "actors" if serving and cuda and parallel.dp_size >= GROUP_ACTORS_MIN_DP else "driver"
    bundle = cuda if parallel.bundle_gpus is None else parallel.bundle_gpus
    return dataclasses.replace(
        config, device=device, dtype=dtype, fanout=config.fanout or ("compiled" if cuda else "channel"),
        group_schedulers=groups, overlap=dataclasses.replace(overlap, enable_tbo=tbo),
        parallel=dataclasses.replace(parallel, bundle_gpus=bundle))
