"""The device decision and the ranks' GPUs on the session's Ray cluster, whose nodes declare GPUs that this CPU-only
torch cannot use (``conftest.ray_cluster``: 2 per node): ``auto`` computes on CPU and says why, ``cuda`` fails the
start within seconds with the rank's ``RankDeviceError`` (offline and served), a rank actor takes the GPU Ray
assigned it, and a rank group's start reports its stages and honours its bounds."""

from __future__ import annotations

import os
import time

import pytest
import torch

from raymoe.config import EngineConfig, GraphConfig, ParallelConfig
from raymoe.errors import EngineUnhealthyError

pytestmark = pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a CPU-only torch (emulated GPUs)")


def test_auto_on_emulated_gpus_computes_on_cpu_and_says_why(ray_cluster, tiny_model):
    from raymoe.cluster.device_choice import gather_evidence, resolve_engine_config

    cluster = gather_evidence("cluster")
    assert (cluster.gpus, cluster.autoscaler_gpus, gather_evidence("node").gpus) == (6, 0, 2)  # no autoscaler here
    for world, serving in ((2, False), (1, True)):
        config = EngineConfig(model=tiny_model, parallel=ParallelConfig(dp_size=world, ep_size=world))
        resolved, choice = resolve_engine_config(config, serving=serving)
        assert resolved.device == "cpu" and resolved.dtype == "float32" and "not a CUDA build" in choice.reason
        assert not resolved.parallel.bundle_gpus


def test_cuda_on_emulated_gpus_fails_the_start_naming_the_rank_error(ray_cluster, tiny_model):
    """The front end cannot tell emulated GPUs from real ones; the ranks can, and refuse before any collective."""
    import ray

    from raymoe import Engine

    def ours() -> set[str]:
        return {pg["name"] for pg in ray.util.placement_group_table().values()
                if pg["state"] == "CREATED" and pg["name"].startswith("raymoe-tp")}

    before = ours()
    with pytest.raises(EngineUnhealthyError, match="RankDeviceError: rank \\d is configured for CUDA but sees no GPU"):
        Engine(tiny_model, dp_size=2, ep_size=2, device="cuda", disable_cuda_graph=True)
    assert ours() <= before  # its GPU bundles were released


def test_served_cuda_one_rank_fails_the_start_naming_the_rank_error(ray_cluster, tiny_model):
    """One rank, served: the driver actor asks Ray for this node's GPU and computes the rank itself; its
    constructor's RankDeviceError ends the start at once (Ray does not restart an actor whose constructor raised)."""
    from raymoe.client.engine_client import EngineClient

    config = EngineConfig(model=tiny_model, device="cuda", graph=GraphConfig(disable_cuda_graph=True))
    with pytest.raises(EngineUnhealthyError, match="RankDeviceError: rank 0 is configured for CUDA but sees no GPU"):
        EngineClient(config, start_timeout_s=120)


def test_rank_actors_take_the_gpu_ray_assigned_them(ray_cluster):
    """Two one-GPU actors on one node get different GPUs; each finds its own as device 0 of the GPUs Ray lets it
    see, or, with Ray told not to narrow CUDA_VISIBLE_DEVICES, at the position of its id."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def gpu_of_this_actor() -> tuple[list, str | None, int]:  # runs in the actor (pickled by value)
        from raymoe.runner.device import cuda_device_index, ray_assigned_gpu_ids

        ids = ray_assigned_gpu_ids()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return ids, visible, cuda_device_index(ids, visible, os.environ.get("LOCAL_RANK"))

    pg = placement_group([{"CPU": 0.1, "GPU": 1}] * 2, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    probe = ray.remote(gpu_of_this_actor)
    try:
        def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

        narrowed = ray.get([probe.options(num_cpus=0.1, num_gpus=1, scheduling_strategy=in_bundle(i)).remote()
                            for i in range(2)], timeout=120)
        ids = [r[0] for r in narrowed]
        assert all(len(i) == 1 for i in ids) and ids[0] != ids[1]
        assert [(visible, index) for _, visible, index in narrowed] == [(str(i[0]), 0) for i in ids]
        env = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0,1"}}
        (gpu,), visible, index = ray.get(probe.options(num_cpus=0.1, num_gpus=1, runtime_env=env,
                                                       scheduling_strategy=in_bundle(0)).remote(), timeout=120)
        assert visible == "0,1" and index == [0, 1].index(int(gpu))
    finally:
        remove_placement_group(pg)


def test_rank_group_start_reports_its_stages(ray_cluster, tiny_model):
    """Placed, joined, weights loaded, graphs captured: one line each, in that order, from the executor that the
    driver actor runs (its stderr reaches the ``raymoe serve`` console through Ray's log forwarding)."""
    from raymoe.actors.executor import RayExecutor
    from raymoe.actors.factory import runner_config_for, startup_kwargs
    from raymoe.config.device_defaults import with_device

    config = with_device(EngineConfig(model=tiny_model, parallel=ParallelConfig(dp_size=2, ep_size=2),
                                      graph=GraphConfig(cuda_graph_bs=(1, 2))), "cpu")
    kwargs = startup_kwargs(config)
    assert kwargs["load_timeout_s"] > 120 and kwargs["placement_timeout_s"] == 180
    lines: list[str] = []
    ex = RayExecutor(runner_config_for(config), config.parallel, use_gpu=False, fanout="remote",
                     placement_timeout_s=60, load_timeout_s=kwargs["load_timeout_s"], progress=lines.append)
    try:
        assert ex.ranks_alive()
    finally:
        ex.shutdown()
    stages = ["2 ranks placed", "2 ranks joined their process groups", "weights loaded on 2 ranks",
              "2 decode graphs captured per rank"]
    assert [next(i for i, line in enumerate(lines) if line.startswith(s)) for s in stages] == list(range(4)), lines


def test_a_stage_past_its_bound_fails_naming_the_option(ray_cluster):
    import ray

    from raymoe.actors.startup_progress import wait_all

    def sleep(seconds: float) -> None:
        time.sleep(seconds)

    nap = ray.remote(num_cpus=0.1)(sleep)
    ray.get([nap.remote(0.5), nap.remote(0.5)], timeout=60)  # two warm workers: the bound below is not start-up
    lines: list[str] = []
    refs = [nap.remote(0), nap.remote(60)]
    try:
        with pytest.raises(TimeoutError, match="1 of 2 rank\\(s\\) still busy after 8 s \\(the bound is "
                                               "load_timeout_s\\)"):
            wait_all(refs, 8.0, "loading weights", lines.append, "load_timeout_s", every_s=0.5)
    finally:
        ray.cancel(refs[1], force=True)
    assert any(line.startswith("loading weights: 1 of 2 rank(s) done") for line in lines), lines
    assert wait_all([nap.remote(0)], 30.0, "x", None, "y") == [None]


def test_raymoe_serve_device_cuda_without_gpus_exits_naming_cuda(tiny_model):
    """``raymoe serve --device cuda`` on this machine (its local Ray declares no GPU) exits non-zero before any
    actor starts, saying CUDA and GPU; run as a user would, in a fresh process with its own local Ray."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from raymoe.cluster.bootstrap import free_port

    ray_tmp = tempfile.mkdtemp(prefix="rmd-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
                                                            "GLOO_SOCKET_IFNAME")}
    env["RAY_TMPDIR"] = ray_tmp
    cmd = [sys.executable, "-m", "raymoe.cli", "serve", "--model", tiny_model, "--device", "cuda", "--port",
           str(free_port())]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    error = proc.stderr[proc.stderr.rfind("error: "):].splitlines()[0]  # after the start-up bar's last redraw
    assert error.startswith("error: device: cuda was requested") and "GPU" in error, proc.stderr[-2000:]
    assert "DriverActor" not in proc.stdout + proc.stderr  # refused before the driver actor started
