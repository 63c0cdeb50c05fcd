"""The CUDA device of each GPU rank actor, set from Ray's GPU assignment before the rank touches CUDA.

Ray starts an actor that asks for one GPU with ``CUDA_VISIBLE_DEVICES`` naming that GPU alone. A rank then
computes on the right GPU, but it cannot open CUDA IPC handles of the other ranks' GPUs on its node, which DeepEP's
NVLink buffers (``cudaIpcOpenMemHandle`` in ``Buffer::sync``) and NCCL's peer-to-peer paths need. So, as vLLM's
Ray executor does (it sets each worker's ``CUDA_VISIBLE_DEVICES`` to the GPU ids of the workers on its node) and
SGLang's ranks do (``gpu_id = rank % gpus_per_node`` with the node's GPUs visible), :func:`bind_cuda_devices` asks
every rank actor for ``ray.get_gpu_ids()``, and gives it ``CUDA_VISIBLE_DEVICES`` = the GPU ids of its node's ranks
in rank order and ``LOCAL_RANK`` = its position among them (``raymoe.cluster.rank_plan.rank_cuda_devices``), which
``raymoe.runner.device.rank_device`` makes current. Under the node-ordered plan rank ``r`` computes on
``cuda:(r % G)``, the GPU Ray reserved for it; only GPUs this engine's ranks hold become visible.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

from raymoe.cluster.rank_plan import RankDevice, rank_cuda_devices


def bind_cuda_devices(workers: Sequence, node_ids: Sequence[Hashable], timeout_s: float) -> list[RankDevice]:
    """Give each rank actor of ``workers`` (rank order; each placed on the node ``node_ids[r]`` with one GPU) its
    CUDA device: ``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK`` in its process. Call it before any rank initializes
    CUDA (before ``init_distributed``). Works on any Ray actor (``__ray_call__``), so tests probe it with tiny
    actors. Returns the devices, in rank order.

    Raises:
        PlacementError: a rank holds other than one GPU, or two ranks of a node hold the same one.
        RuntimeError: a rank already initialized CUDA (its visible devices can no longer change).
        ray.exceptions.GetTimeoutError: the actors did not answer within ``timeout_s`` seconds.
    """
    import ray

    gpu_ids = ray.get([w.__ray_call__.remote(_ray_gpu_ids) for w in workers], timeout=timeout_s)
    devices = rank_cuda_devices(node_ids, gpu_ids)
    ray.get([w.__ray_call__.remote(_use_device, d) for w, d in zip(workers, devices, strict=True)],
            timeout=timeout_s)
    return devices


def _ray_gpu_ids(_actor) -> list[str]:
    """In the actor: the GPU ids Ray assigned to it."""
    import ray

    return [str(g) for g in ray.get_gpu_ids()]


def _use_device(_actor, device: RankDevice) -> None:
    """In the actor: make ``device`` the one ``rank_device`` takes (environment read when CUDA initializes)."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("this rank initialized CUDA before its device was bound; CUDA_VISIBLE_DEVICES can no "
                           "longer change")
    os.environ["CUDA_VISIBLE_DEVICES"] = device.visible_devices
    os.environ["LOCAL_RANK"] = str(device.device_index)
