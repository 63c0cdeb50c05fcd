"""Which device a rank computes on, decided once and never silently changed.

A rank configured for CUDA that sees no GPU is a deployment error (a wrong ``CUDA_VISIBLE_DEVICES``, a Ray
actor placed without ``num_gpus``); falling back to CPU would put it in a gloo world while its peers use NCCL,
and the first collective would hang. So it fails at start-up with :class:`RankDeviceError`. The engine's device
itself is decided before any rank starts (``raymoe.cluster.device_choice``); a rank only finds its GPU.
"""

from __future__ import annotations

import os

import torch

from raymoe.errors import RaymoeError


class RankDeviceError(RaymoeError):
    """A rank cannot use the device it was configured for."""


def cuda_device_index(gpu_ids: list | None, visible: str | None, local_rank: str | None) -> int:
    """Index, among the GPUs this process's CUDA runtime sees, of the GPU a rank must use.

    In a Ray actor that asked for one GPU (``num_gpus=1``), Ray assigns it (``ray.get_gpu_ids()``) and, unless
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is set, narrows ``CUDA_VISIBLE_DEVICES`` to it: the index is
    the assigned id's position in ``CUDA_VISIBLE_DEVICES`` (0 when Ray narrowed it; the id itself when the variable
    is unset, i.e. the runtime sees every GPU of the node). Outside Ray (no assignment) it is ``LOCAL_RANK``, else 0.

    Args:
        gpu_ids: ``ray.get_gpu_ids()`` in a Ray worker (ids as ints or strings, e.g. UUIDs), else None or empty.
        visible: ``$CUDA_VISIBLE_DEVICES`` (None: unset). local_rank: ``$LOCAL_RANK`` (None: unset).
    Raises:
        RankDeviceError: Ray assigned this process more or fewer than one GPU, or the assigned one is not among the
            visible devices.
    """
    if not gpu_ids:
        return int(local_rank or 0)
    if len(gpu_ids) != 1:
        raise RankDeviceError(f"a rank uses exactly one GPU, but Ray assigned this process {list(gpu_ids)}")
    assigned = str(gpu_ids[0])
    if visible is None:
        return int(assigned)
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if assigned not in listed:
        raise RankDeviceError(f"Ray assigned GPU {assigned}, which CUDA_VISIBLE_DEVICES={visible!r} hides")
    return listed.index(assigned)


def ray_assigned_gpu_ids() -> list:
    """``ray.get_gpu_ids()`` inside a Ray worker, else ``[]`` (Ray is not imported for that)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    return list(ray.get_gpu_ids())


def rank_device(requested: str, rank: int = 0) -> torch.device:
    """The ``torch.device`` of a rank configured for ``requested``, made current for CUDA.

    For ``"cuda"`` the rank uses the GPU Ray assigned to its actor (:func:`cuda_device_index`; ``LOCAL_RANK`` or 0
    outside Ray) and calls ``torch.cuda.set_device`` on it, so NCCL and every allocation use that GPU. ``"cpu"`` and
    ``"meta"`` (device-cleanliness tests) are returned as they are.

    Raises:
        RankDeviceError: CUDA requested but no GPU is visible to this process, Ray assigned it other than one GPU,
            or the index names a GPU that is not visible.
        ValueError: an unknown device name.
    """
    if requested in ("cpu", "meta"):
        return torch.device(requested)
    if requested != "cuda":
        raise ValueError(f"unknown device {requested!r}")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise RankDeviceError(f"rank {rank} is configured for CUDA but sees no GPU (CUDA_VISIBLE_DEVICES="
                              f"{visible}); give its actor a GPU (num_gpus) or run with device='cpu'")
    index = cuda_device_index(ray_assigned_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                              os.environ.get("LOCAL_RANK"))
    if not 0 <= index < torch.cuda.device_count():
        raise RankDeviceError(f"rank {rank}: GPU index {index} but only {torch.cuda.device_count()} GPU(s) are "
                              "visible")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device
