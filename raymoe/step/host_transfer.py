"""Host values to the rank's device without a host sync (the one way a step's Python lists become tensors).

``torch.tensor(values, device=cuda)`` builds the tensor on the host and copies it with ``non_blocking=False``
(``internal_new_from_data`` in ``torch/csrc/utils/tensor_new.cpp``), and a blocking host-to-device copy ends in
``cudaStreamSynchronize`` (``copy_kernel_cuda`` -> ``memcpy_and_sync`` in ``aten/src/ATen/native/cuda/Copy.cu``):
the host would wait for every kernel already queued, so preparing step N+1 would wait for step N to finish. Here
the tensor is built on the host and sent with ``non_blocking=True`` (``cudaMemcpyAsync`` from pageable memory
stages the bytes and returns without waiting for the stream, as SGLang's ``ScheduleBatch`` does). On a CPU rank
the host tensor is the result.

``raymoe.platform.reference.sync_guard.HostSyncGuard(device=...)`` refuses ``torch.tensor(..., device=<rank
device>)`` inside a decode step, so every such conversion goes through :func:`to_device`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a flat Python sequence) as a 1-D ``dtype`` tensor on ``device``, copied without a host sync.

    Args:
        values: the numbers, host side (a list of ints or floats; may be empty).
        dtype: the tensor's dtype (e.g. ``torch.int64`` for ids and slots, ``torch.float32`` for sampling rows).
        device: the rank's device.
    Returns:
        [len(values)] ``dtype`` on ``device``; on CUDA its copy is queued on the current stream and is valid for
        every kernel queued after it.
    """
    # Built on the host whatever torch's default device is (a rank may set one), without naming the host device
    # where it is the default: HostSyncGuard(device=cpu) refuses an explicit device, as it would on a GPU rank.
    if torch.get_default_device().type == "cpu":
        host = torch.tensor(values, dtype=dtype)
    else:
        host = torch.tensor(values, dtype=dtype, device="cpu")
    device = torch.device(device)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)
