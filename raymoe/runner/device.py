"""Which device a rank computes on, decided once and never silently changed.

A rank configured for CUDA that sees no GPU is a deployment error (a wrong ``CUDA_VISIBLE_DEVICES``, a Ray
actor placed without ``num_gpus``); falling back to CPU would put it in a gloo world while its peers use NCCL,
and the first collective would hang. So it fails at start-up with :class:`RankDeviceError`.
"""

from __future__ import annotations

import os

import torch

from raymoe.errors import RaymoeError


class RankDeviceError(RaymoeError):
    """A rank cannot use the device it was configured for."""


def engine_device(requested: str | None) -> str:
    """The device every rank of an engine uses: ``requested`` (``"cpu"``/``"cuda"``), or for None ``"cuda"``
    when this process sees a GPU, else ``"cpu"`` (decided once, where the engine is configured)."""
    if requested is not None:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def rank_device(requested: str, rank: int = 0) -> torch.device:
    """The ``torch.device`` of a rank configured for ``requested``, made current for CUDA.

    For ``"cuda"`` the rank uses visible GPU ``LOCAL_RANK`` (0 when unset: Ray gives each rank actor exactly its
    own GPU through ``CUDA_VISIBLE_DEVICES``) and calls ``torch.cuda.set_device`` on it, so NCCL and every
    allocation use that GPU. ``"cpu"`` and ``"meta"`` (device-cleanliness tests) are returned as they are.

    Raises:
        RankDeviceError: CUDA requested but no GPU is visible to this process, or ``LOCAL_RANK`` names a GPU that
            is not visible.
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
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 <= index < torch.cuda.device_count():
        raise RankDeviceError(f"rank {rank}: LOCAL_RANK={index} but only {torch.cuda.device_count()} GPU(s) "
                              "are visible")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device
