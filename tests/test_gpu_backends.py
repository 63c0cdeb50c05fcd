"""GPU backends are optional: choosing one that cannot run fails when the engine is configured, naming the
package; ``raymoe env`` reports what is there; importing raymoe never needs CUDA, DeepEP or flash-attention."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from raymoe.config import EngineConfig, MoeCommConfig, ParallelConfig
from raymoe.errors import InvalidRequestError
from raymoe.platform.backends import REPORTED_DISTRIBUTIONS, environment_report, module_available


def test_gpu_backend_without_its_package_is_a_config_error(tiny_model, monkeypatch):
    monkeypatch.setattr("raymoe.platform.backends.module_available", lambda name: False)
    with pytest.raises(InvalidRequestError, match="deep_ep") as e:
        EngineConfig(model=tiny_model, device="cuda", moe_comm=MoeCommConfig(a2a_backend="deepep"))
    assert e.value.field == "a2a_backend"
    with pytest.raises(InvalidRequestError, match="vllm") as e:
        EngineConfig(model=tiny_model, device="cuda", attention_backend="flash_attn")
    assert e.value.field == "attention_backend"


def test_gpu_backend_on_cpu_is_a_config_error(tiny_model, monkeypatch):
    monkeypatch.setattr("raymoe.platform.backends.module_available", lambda name: True)  # even when installed
    with pytest.raises(InvalidRequestError, match="CUDA only"):
        EngineConfig(model=tiny_model, device="cpu", moe_comm=MoeCommConfig(a2a_backend="deepep"))
    with pytest.raises(InvalidRequestError, match="bfloat16") as e:
        EngineConfig(model=tiny_model, device="cuda", dtype="float32", moe_comm=MoeCommConfig(a2a_backend="deepep"))
    assert e.value.field == "dtype"
    EngineConfig(model=tiny_model, device="cuda", dtype="bfloat16", moe_comm=MoeCommConfig(a2a_backend="deepep"))
    for device in ("cuda", "auto"):  # dtype auto is bfloat16 wherever the ranks may compute on CUDA
        EngineConfig(model=tiny_model, device=device, moe_comm=MoeCommConfig(a2a_backend="deepep"))
    deepep = {"device": "cuda", "moe_comm": MoeCommConfig(a2a_backend="deepep")}
    for ep in (12, 24):  # DeepEP's kernels: 2, 4, 8 ranks in a node, or 2-20 nodes of 8 (3 nodes: none)
        with pytest.raises(InvalidRequestError, match="ep_size") as e:
            EngineConfig(model=tiny_model, parallel=ParallelConfig(dp_size=ep, ep_size=ep), **deepep)
        assert e.value.field == "ep_size"
    EngineConfig(model=tiny_model, parallel=ParallelConfig(dp_size=16, ep_size=16), **deepep)
    with pytest.raises(InvalidRequestError, match="a2a_mode"):
        MoeCommConfig(a2a_mode="fastest")
    with pytest.raises(InvalidRequestError, match="num_max_dispatch_tokens_per_rank"):
        MoeCommConfig(num_max_dispatch_tokens_per_rank=0)


def test_env_report_and_imports_without_gpu_packages():
    report = environment_report()
    assert report["torch"] and report["cuda.is_available"] in ("True", "False")
    assert report["a2a_backend=deepep"].startswith("ok" if module_available("deep_ep") else "missing")
    assert report["pip torch"] == torch.__version__  # the installed distribution's metadata, not an import
    assert report["pip vllm"] == (importlib.metadata.version("vllm") if module_available("vllm") else "not installed")
    assert set(REPORTED_DISTRIBUTIONS) >= {"vllm", "sgl-deep-ep", "torch"}
    # importing raymoe (engine, models, GPU adapters' modules) must not import CUDA-only packages
    code = ("import sys, raymoe, raymoe.engine, raymoe.comm.dispatcher, raymoe.platform.backends; "
            "bad = [m for m in ('deep_ep', 'vllm', 'flash_attn') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
