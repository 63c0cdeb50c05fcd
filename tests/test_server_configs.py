"""Deployment files: every config in configs/ parses and names only entrypoints that exist (Serve import paths
and their args, CLI commands of the benchmark job), and the Grafana dashboard queries only exported metrics."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml
from server_harness import dashboard_metrics, exported_names

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def _serve_applications() -> list[tuple[str, dict]]:
    apps = [("serve.yaml", a) for a in yaml.safe_load((CONFIGS / "serve.yaml").read_text())["applications"]]
    service = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())
    apps += [("kuberay-rayservice.yaml", a) for a in yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]]
    return apps


def test_every_yaml_parses():
    files = sorted(CONFIGS.glob("*.yaml"))
    assert {f.name for f in files} >= {"serve.yaml", "cluster.yaml", "kuberay-rayservice.yaml"}
    for f in files:
        assert isinstance(yaml.safe_load(f.read_text()), dict), f


@pytest.mark.parametrize(("source", "app"), _serve_applications(), ids=lambda x: x if isinstance(x, str) else "")
def test_serve_applications_name_a_builder_with_valid_args(source, app):
    from ray.serve import Application

    from raymoe.deploy.server_config import ServeOptions

    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    ServeOptions(**app["args"])  # every arg is a known option with a valid value
    assert isinstance(builder(app["args"]), Application)
    from raymoe.deploy.serve_app import RaymoeDeployment

    assert {d["name"] for d in app["deployments"]} <= {RaymoeDeployment.name}


def test_cluster_launcher_has_an_autoscaling_gpu_group():
    cfg = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    assert cfg["head_node_type"] in cfg["available_node_types"]
    workers = [t for n, t in cfg["available_node_types"].items() if n != cfg["head_node_type"]]
    assert any(t["min_workers"] < t["max_workers"] and "g5" in t["node_config"]["InstanceType"] for t in workers)
    assert any("raymoe" in c for c in cfg["setup_commands"])

    service = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    assert service["enableInTreeAutoscaling"]
    gpu = service["workerGroupSpecs"][0]
    assert gpu["minReplicas"] < gpu["maxReplicas"]
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    docker_tag = re.search(r"rayproject/ray:([0-9.]+)", (CONFIGS / "Dockerfile").read_text()).group(1)
    assert service["rayVersion"] == docker_tag


_NUMERIC = ("DP", "TP", "PORT", "CONCURRENCY", "NUM_PROMPTS", "OUTPUT_LEN")


def _env_value(m: re.Match) -> str:
    return "8" if m.group(1) in _NUMERIC else "x"


def _raymoe_commands(script: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", script)
    cmds = []
    for line in joined.splitlines():
        line = line.split(" &")[0].strip()
        if line.startswith("raymoe "):
            line = re.sub(r'"\$\{DATASET_ARGS\[@\]\}"', "--dataset-path data.jsonl", line)
            line = re.sub(r"\$\{?([A-Z_]+)\}?", _env_value, line)
            cmds.append(shlex.split(line)[1:])
    return cmds


def test_benchmark_job_runs_existing_commands():
    from raymoe.cli import build_parser

    cmds = _raymoe_commands((CONFIGS / "bench_job.sh").read_text())
    assert [c[:2] for c in cmds] == [["serve", "--address"], ["bench", "serve"]]
    for argv in cmds:
        args = build_parser().parse_args(argv)
        assert callable(args.func)


def test_dashboard_queries_only_metrics_the_server_exports():
    from raymoe.actors.dp_router import RouteCounters
    from raymoe.actors.driver_service import EngineStats
    from raymoe.actors.step_timing import StepTimer
    from raymoe.deploy.metrics import ServerMetrics
    from raymoe.eplb.report import ExpertLoadReport

    m = ServerMetrics("tiny")
    r = m.request()
    r.tokens(1)
    r.tokens(2)
    r.finish("stop", prompt_tokens=5, completion_tokens=3)
    m.error(429)
    timer = StepTimer()
    timer.collected("decode", timer.clock(), 0.002)
    stats = EngineStats(num_running=1, num_waiting=2, kv_usage=0.25, radix_hit_tokens=7, num_steps=10,
                        num_tbo_steps=4, healthy=True, step_seconds=[0.01, 0.02], step_times=timer.snapshot(),
                        expert_load=ExpertLoadReport(2, 2, 16, [[3, 1], [2, 2]], [0.67, 1.0], [[0, 1], [0, 1]]),
                        routing=RouteCounters(by_prefix=3, by_load=2, capped=1, expected_cached_tokens=64))
    samples, _ = exported_names(m.render(stats).decode())
    queried = dashboard_metrics()
    assert queried <= samples, queried - samples


def test_clusters_require_the_ray_token_and_keep_the_dashboard_private():
    cfg = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    head, workers = " ".join(cfg["head_start_ray_commands"]), " ".join(cfg["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head and "RAY_AUTH_MODE=token" in workers
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert "~/.ray/auth_token" in cfg["file_mounts"]  # every node gets the token

    spec = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())["spec"]
    service = spec["rayClusterConfig"]
    assert service["authOptions"]["mode"] == "token"
    assert tuple(map(int, service["rayVersion"].split(".")[:2])) >= (2, 52)  # first Ray with token auth
    assert service["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    assert yaml.safe_load(spec["serveConfigV2"]).get("http_options", {}).get("host") in (None, "127.0.0.1")

    job = (CONFIGS / "bench_job.sh").read_text()
    assert re.search(r'^export RAY_AUTH_MODE="\$\{RAY_AUTH_MODE:-token\}"$', job, re.M)
    assert "--host 127.0.0.1" in job and "0.0.0.0" not in job
    serve = yaml.safe_load((CONFIGS / "serve.yaml").read_text())
    assert serve["http_options"]["host"] == "127.0.0.1"


def test_serve_limit_flags_reach_server_limits():
    from raymoe.cli import build_parser
    from raymoe.deploy.cli import limits_from_args
    from raymoe.errors import InvalidRequestError

    limits = limits_from_args(build_parser().parse_args(["serve", "--max-body-bytes", "4096", "--max-stop-strings", "8",
                                                "--default-timeout-s", "30"]))
    assert (limits.max_body_bytes, limits.max_stop_strings, limits.default_timeout_s) == (4096, 8, 30.0)
    assert limits.max_timeout_s == 3600.0  # flags not given keep their defaults
    with pytest.raises(InvalidRequestError, match="default_timeout_s"):
        limits_from_args(build_parser().parse_args(["serve", "--max-timeout-s", "5"]))


SITE_ARGS = {"model", "served_model_name", "device", "dtype", "dp_size", "ep_size", "max_running_requests"}
"""Serve app args that may differ between configs/serve.yaml (local demo) and the KubeRay RayService (a real
model on GPU nodes); every other arg, and every deployment option, must be the same."""


def _serve_configs() -> dict[str, dict]:
    service = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())
    return {"serve.yaml": yaml.safe_load((CONFIGS / "serve.yaml").read_text()),
            "kuberay-rayservice.yaml": yaml.safe_load(service["spec"]["serveConfigV2"])}


@pytest.mark.parametrize("source", ["serve.yaml", "kuberay-rayservice.yaml"])
def test_serve_configs_pass_rays_serve_deploy_schema(source):
    """Ray's own pydantic model of ``serve deploy`` / ``serveConfigV2`` accepts the config, and reads the
    autoscaling bounds we rely on (1 to 2 engines); the schema is strict enough to refuse ``num_replicas`` beside
    ``autoscaling_config``."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    raw = _serve_configs()[source]
    schema = ServeDeploySchema(**raw)
    (deployment,) = schema.applications[0].deployments
    auto = deployment.autoscaling_config
    assert (auto["min_replicas"], auto["max_replicas"]) == (1, 2)
    assert auto["target_ongoing_requests"] <= deployment.max_ongoing_requests
    assert {"upscale_delay_s", "downscale_delay_s"} <= auto.keys()

    raw["applications"][0]["deployments"][0]["num_replicas"] = 1
    with pytest.raises(ValidationError, match="num_replicas"):
        ServeDeploySchema(**raw)


def test_kuberay_embeds_the_serve_yaml_applications():
    """The RayService runs the same applications as configs/serve.yaml: same names, routes, import paths,
    deployments (autoscaling included) and arg names; only :data:`SITE_ARGS` values differ."""
    local, kuberay = (c["applications"] for c in _serve_configs().values())
    assert len(local) == len(kuberay)
    for a, b in zip(local, kuberay, strict=True):
        assert {k: v for k, v in a.items() if k != "args"} == {k: v for k, v in b.items() if k != "args"}
        assert a["args"].keys() == b["args"].keys()
        assert {k: v for k, v in a["args"].items() if k not in SITE_ARGS} == \
            {k: v for k, v in b["args"].items() if k not in SITE_ARGS}


def test_cluster_yaml_passes_rays_cluster_launcher_schema():
    """configs/cluster.yaml against the JSON schema that ``ray up`` itself validates with
    (``ray/autoscaler/ray-schema.json``, shipped in the ray wheel); the schema refuses unknown keys, so a
    misspelt field fails here rather than at ``ray up``."""
    import json

    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cfg = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    jsonschema.validate(cfg, schema)
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        jsonschema.validate({**cfg, "max_worker": 8}, schema)


def test_ray_job_script_submits_bench_job_with_variables_it_reads():
    """benchmarks/ray_job_bench.sh submits the documented job (working dir configs/, ``bash bench_job.sh``) with
    env_vars that configs/bench_job.sh reads (plus PYTHONPATH), so a renamed variable fails here."""
    script = (ROOT / "benchmarks" / "ray_job_bench.sh").read_text()
    job = (CONFIGS / "bench_job.sh").read_text()
    assert re.search(r"ray job submit .*--working-dir configs", script)
    assert '-- bash bench_job.sh' in script and "RAY_AUTH_MODE=token" in script
    env_line = next(line for line in script.splitlines() if line.startswith("ENV_JSON=$(printf"))
    names = set(re.findall(r'"(\w+)": "%s"', env_line))
    read = set(re.findall(r"\$\{(\w+):[-?]", job))
    assert {"MODEL", "DP", "OUT", "NUM_PROMPTS"} <= names
    assert names - {"PYTHONPATH"} <= read, names - read
    assert "ray stop" not in script.replace("never `ray stop`", "")


def test_two_batch_overlap_defaults_on_for_cuda_ranks_only():
    from raymoe.config.device_defaults import with_device
    from raymoe.deploy.server_config import ServeOptions

    def tbo(device: str, **kw) -> bool:  # as the EngineClient decides it, once the device is known
        return with_device(ServeOptions(**kw).engine_config("/m"), device).overlap.enable_tbo

    assert tbo(dp_size=2, device="cuda") and not tbo(dp_size=2, device="cpu")  # ep = world by default
    assert not tbo(dp_size=1, device="cuda")  # one EP rank: no all-to-all to hide
    assert tbo(dp_size=2, device="cpu", enable_tbo=True) and not tbo(dp_size=2, device="cuda", enable_tbo=False)


@pytest.mark.parametrize("source", ["serve.yaml", "kuberay-rayservice.yaml"])
def test_serve_configs_drain_replicas_for_streams(source):
    """Both configs carry the deployment's own stop settings (the config's values replace the decorator's): the
    replacement starts first, and a stopping replica has the same time to finish its streams."""
    from ray.serve.schema import ServeDeploySchema

    from raymoe.deploy import serve_app

    (deployment,) = ServeDeploySchema(**_serve_configs()[source]).applications[0].deployments
    assert deployment.max_surge_percent == serve_app.MAX_SURGE_PERCENT == 100
    assert deployment.graceful_shutdown_timeout_s == serve_app.GRACEFUL_SHUTDOWN_TIMEOUT_S
    assert deployment.graceful_shutdown_wait_loop_s == serve_app.GRACEFUL_SHUTDOWN_WAIT_LOOP_S
    config = serve_app.RaymoeDeployment._deployment_config
    assert config.max_surge_percent == 100
    assert config.graceful_shutdown_timeout_s == serve_app.GRACEFUL_SHUTDOWN_TIMEOUT_S


def test_kuberay_pods_outlive_a_replica_drain_and_probe_readiness():
    """Every pod's grace period covers Serve's drain of a replica; the serving (GPU worker) pods, which run a Serve
    proxy each, probe a readiness route the app has, and leave liveness to KubeRay's default (the raylet)."""
    from raymoe.deploy.serve_app import GRACEFUL_SHUTDOWN_TIMEOUT_S

    spec = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())["spec"]
    assert yaml.safe_load(spec["serveConfigV2"])["proxy_location"] == "EveryNode"
    cluster = spec["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert pod["terminationGracePeriodSeconds"] >= GRACEFUL_SHUTDOWN_TIMEOUT_S + 30
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    probe = worker["readinessProbe"]
    assert probe["httpGet"] == {"path": "/ready", "port": 8000}
    from raymoe.deploy.probes import ENGINE_PROBE_TIMEOUT_S

    assert probe["timeoutSeconds"] > ENGINE_PROBE_TIMEOUT_S  # the route answers 503 before the probe gives up
    assert "livenessProbe" not in worker
    import inspect

    from raymoe.deploy import openai_api

    assert '@app.get("/ready"' in inspect.getsource(openai_api.build_openai_app)  # answered in test_drain.py
