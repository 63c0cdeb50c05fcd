"""The ranks' device is decided once, before any actor starts, from what is known where the ranks will run; every
per-device default follows from it; ``cuda`` where no GPU is fails at once, naming CUDA, and is never turned into
CPU. (The Ray-cluster side of it: ``tests/test_device_cluster.py``.)"""

from __future__ import annotations

import dataclasses

import pytest

from raymoe.cluster.device_choice import DeviceEvidence, choose_device, resolve_engine_config
from raymoe.config import EngineConfig, MoeCommConfig, OverlapConfig, ParallelConfig
from raymoe.config.device_defaults import with_device
from raymoe.errors import InvalidRequestError


def _evidence(scope: str, gpus: float, built: bool = True) -> DeviceEvidence:
    return DeviceEvidence(scope, gpus, built, "2.13.0")


@pytest.mark.parametrize("scope", ["process", "node", "cluster"])
def test_cuda_without_gpus_is_refused_naming_cuda(scope):
    for built in (True, False):
        with pytest.raises(InvalidRequestError, match="cuda was requested") as e:
            choose_device("cuda", _evidence(scope, 0, built), world_size=4)
        assert e.value.field == "device" and "GPU" in e.value.message and "device cpu" in e.value.message
    assert choose_device("cuda", _evidence(scope, 8), 4).device == "cuda"


def test_auto_follows_the_gpus_where_the_ranks_run():
    assert choose_device("auto", _evidence("cluster", 16), 16).device == "cuda"
    assert choose_device("auto", _evidence("node", 1), 1).device == "cuda"
    assert choose_device("auto", _evidence("process", 0), 1).device == "cpu"
    assert choose_device("auto", _evidence("cluster", 0), 2).device == "cpu"
    # emulated GPUs (a ray.cluster_utils.Cluster on a CPU-only torch): CPU, and the reason says why
    emulated = choose_device("auto", _evidence("cluster", 6, built=False), 2)
    assert emulated.device == "cpu" and "not a CUDA build" in emulated.reason and "device cuda" in emulated.reason
    # asking for cuda there is not refused by the front end: each rank refuses if it sees no GPU (RankDeviceError)
    assert choose_device("cuda", _evidence("cluster", 6, built=False), 2).device == "cuda"
    fewer = choose_device("cuda", _evidence("cluster", 4), 8)
    assert fewer.device == "cuda" and "wait" in fewer.reason  # an autoscaler may add the rest
    assert choose_device("cpu", _evidence("cluster", 8), 8).device == "cpu"
    # no GPU node up yet, but the autoscaler publishes a GPU node group: the ranks' bundles will bring them up
    scaling = DeviceEvidence("cluster", 0, True, "2.13.0", autoscaler_gpus=32)
    for requested in ("auto", "cuda"):
        choice = choose_device(requested, scaling, 16)
        assert choice.device == "cuda" and "autoscaler may add 32" in choice.reason, choice
    with pytest.raises(InvalidRequestError, match="declares 0 GPU.*no autoscaler publishes a GPU node group"):
        choose_device("cuda", DeviceEvidence("cluster", 0, True, "2.13.0", autoscaler_gpus=0), 16)
    with pytest.raises(ValueError):
        choose_device("tpu", _evidence("cluster", 8), 8)


def _config(**kw) -> EngineConfig:
    parallel = kw.pop("parallel", ParallelConfig(dp_size=4, ep_size=4))
    return EngineConfig(model="/m", parallel=parallel, **kw)


def test_every_per_device_default_follows_the_device():
    cuda, cpu = with_device(_config(), "cuda"), with_device(_config(), "cpu")
    assert cuda.resolved and cpu.resolved and not _config().resolved
    assert (cuda.dtype, cuda.overlap.enable_tbo, cuda.fanout, cuda.group_schedulers, cuda.parallel.bundle_gpus) == \
        ("bfloat16", True, "compiled", "actors", True)
    assert (cpu.dtype, cpu.overlap.enable_tbo, cpu.fanout, cpu.group_schedulers, cpu.parallel.bundle_gpus) == \
        ("float32", False, "channel", "driver", False)
    # two-batch overlap only with an all-to-all to hide and without single-batch overlap
    assert not with_device(_config(parallel=ParallelConfig(dp_size=4, ep_size=1)), "cuda").overlap.enable_tbo
    assert not with_device(_config(overlap=OverlapConfig(enable_sbo=True)), "cuda").overlap.enable_tbo
    # group processes: served CUDA engines from GROUP_ACTORS_MIN_DP groups; never offline, never for one rank
    assert with_device(_config(), "cuda", serving=False).group_schedulers == "driver"
    assert with_device(_config(parallel=ParallelConfig(dp_size=2, ep_size=2)), "cuda").group_schedulers == "driver"
    one = with_device(_config(parallel=ParallelConfig(), group_schedulers="actors"), "cuda")
    assert one.group_schedulers == "driver"
    # what was given explicitly stays
    given = _config(dtype="float16", fanout="remote", group_schedulers="driver",
                    overlap=OverlapConfig(enable_tbo=False), parallel=ParallelConfig(dp_size=4, ep_size=4,
                                                                                     bundle_gpus=True))
    kept = with_device(given, "cuda")
    assert (kept.dtype, kept.fanout, kept.group_schedulers, kept.overlap.enable_tbo) == \
        ("float16", "remote", "driver", False)
    assert with_device(given, "cpu").parallel.bundle_gpus  # emulated GPU nodes: CPU compute, GPU bundles
    assert with_device(kept, "cuda") == kept  # deciding again changes nothing
    with pytest.raises(ValueError):
        with_device(_config(), "auto")


def test_decided_values_are_checked_again(tiny_model, monkeypatch):
    """A GPU backend left at device auto is accepted until the device is known, then refused on CPU."""
    monkeypatch.setattr("raymoe.platform.backends.module_available", lambda name: True)
    config = EngineConfig(model=tiny_model, moe_comm=MoeCommConfig(a2a_backend="deepep"))
    assert with_device(config, "cuda").dtype == "bfloat16"
    with pytest.raises(InvalidRequestError, match="CUDA only"):
        with_device(config, "cpu")
    with pytest.raises(InvalidRequestError, match="bundle"):
        EngineConfig(model="/m", device="cuda", parallel=ParallelConfig(bundle_gpus=False))


def test_the_driver_refuses_an_undecided_config(tiny_model):
    from raymoe.actors.factory import runner_config_for

    with pytest.raises(ValueError, match="resolve_engine_config"):
        runner_config_for(EngineConfig(model=tiny_model))
    assert runner_config_for(with_device(EngineConfig(model=tiny_model), "cpu")).device == "cpu"


@pytest.mark.parametrize(("world", "serving", "scope"), [(1, False, "process"), (1, True, "node"),
                                                         (2, False, "cluster"), (2, True, "cluster")])
def test_the_evidence_is_read_where_the_ranks_will_run(monkeypatch, world, serving, scope):
    """An offline one-rank engine computes in this process; a served one in the driver actor on this node; more
    ranks anywhere on the cluster. Ray is joined first for the latter two; device cpu reads nothing."""
    seen: list = []
    monkeypatch.setattr("raymoe.cluster.bootstrap.init_ray", lambda address=None: seen.append(("ray", address)))
    monkeypatch.setattr("raymoe.cluster.device_choice.gather_evidence",
                        lambda s: seen.append(s) or _evidence(s, 2))
    config = _config(parallel=ParallelConfig(dp_size=world, ep_size=world), ray_address="auto")
    resolved, choice = resolve_engine_config(config, serving=serving)
    assert seen[-1] == scope and (("ray", "auto") in seen) == (scope != "process")
    assert choice.device == resolved.device == "cuda" and resolved.resolved
    seen.clear()
    resolved, choice = resolve_engine_config(dataclasses.replace(config, device="cpu"), serving=serving)
    assert seen == [] and resolved.device == "cpu" and choice.reason == "device cpu (requested)"
