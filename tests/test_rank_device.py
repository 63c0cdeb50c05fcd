"""A rank never falls back to another device: CUDA configured without a visible GPU is a clear start-up error."""

from __future__ import annotations

import pytest
import torch

from raymoe.actors.rank_worker import RankWorker
from raymoe.config import GraphConfig, ParallelConfig
from raymoe.runner.device import RankDeviceError, cuda_device_index, rank_device
from raymoe.runner.model_runner import RunnerConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_rank_without_gpu_fails_clearly(tiny_model, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RankDeviceError, match="configured for CUDA but sees no GPU"):
        rank_device("cuda", rank=3)
    cfg = RunnerConfig(model_path=tiny_model, dtype="float32", num_kv_slots=32, max_req_rows=2, max_context_len=16,
                       device="cuda", graph=GraphConfig(disable_cuda_graph=True))
    with pytest.raises(RankDeviceError):
        RankWorker(cfg, ParallelConfig(), rank=0)  # world size 1 loads at construction
    worker = RankWorker(cfg, ParallelConfig(tp_size=1, dp_size=2, ep_size=2), rank=1)
    with pytest.raises(RankDeviceError):  # before joining any process group: peers are not left hanging in NCCL
        worker.init_distributed("tcp://127.0.0.1:1")


def test_a_rank_takes_the_gpu_ray_assigned_it():
    """Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU (index 0), or leaves it alone with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES (index = the id's position); outside Ray, LOCAL_RANK."""
    assert cuda_device_index([3], "3", None) == 0
    assert cuda_device_index([3], "0,1,2,3", "7") == 3  # Ray's assignment wins over LOCAL_RANK
    assert cuda_device_index([5], None, None) == 5  # unset: the runtime sees every GPU of the node
    assert cuda_device_index(["GPU-b"], "GPU-a, GPU-b", None) == 1  # UUIDs
    assert cuda_device_index([], "0,1", "1") == 1 and cuda_device_index(None, None, None) == 0
    with pytest.raises(RankDeviceError, match="exactly one GPU"):
        cuda_device_index([0, 1], "0,1", None)
    with pytest.raises(RankDeviceError, match="hides"):
        cuda_device_index([2], "0,1", None)


def test_cpu_and_meta_devices_pass_through():
    assert rank_device("cpu") == torch.device("cpu")
    assert rank_device("meta") == torch.device("meta")
    with pytest.raises(ValueError):
        rank_device("tpu")
