"""Serve autoscaling of the raymoe app on a local Ray cluster whose autoscaler adds and removes worker nodes
(a script, not a test: about 3 minutes on 2 cores).

What it runs:

* A Ray head started with ``ray start --head --block --autoscaling-config=...`` and ``RAY_FAKE_CLUSTER=1``: the
  autoscaler's ``fake_multinode`` provider, which launches "worker nodes" as extra Ray node processes on this
  machine when resource demand is unmet and terminates idle ones. This is what
  ``ray.cluster_utils.AutoscalingCluster`` does, started by hand because that helper runs ``ray stop --force``
  on start and shutdown (stopping every Ray process of the user on the machine, other people's clusters too),
  and in Ray 2.60 its template (``fake_multi_node/example.yaml``) is missing from the wheel. The head has its
  own ``--temp-dir`` and free ports, token authentication with a random token kept in the environment, and
  every node on 127.0.0.1; it is stopped by its process id, and any leftover process of its temp dir by id.
* Node type ``gpu_worker`` (2 CPUs, 1 emulated GPU; 0 to 2 nodes). The head has 1 CPU, too little for an
  engine replica.
* The Serve app of ``configs/serve.yaml`` (its deployment options: ``autoscaling_config`` min 1, max 2,
  health checks, ``max_ongoing_requests``) with a tiny seeded checkpoint at ``dp_size=1`` (one rank, computing
  inside the replica's driver actor on the replica's node), made reactive for a short run: target 2 ongoing
  requests, upscale after 2 s, downscale after 10 s. Each replica reserves 2 CPUs (its in-process rank's
  cores), so each one needs a worker node of its own.

Ray APIs: ``ray start --autoscaling-config`` with the ``fake_multinode`` provider (the cluster autoscaler
reacting to pending actors), ``serve.start`` / ``serve.run`` with ``Deployment.options(autoscaling_config=...)``
(Serve's replica autoscaler, driven by ongoing requests per replica), ``serve.status()`` (replica states) and
``ray.nodes()`` (alive nodes) to watch both.

Phases: one replica starts (the autoscaler adds the first worker node); a closed loop of 8 concurrent chat
completions runs until Serve has 2 running replicas (the autoscaler adds a second node for the new replica);
then idle until Serve is back to 1 replica and the idle node is removed. Every request must answer 200 with all
its tokens.

Run:  PYTHONPATH=. python benchmarks/serve_autoscaling.py   (exit status 0 when every check holds)
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from ray_head import ROOT, connect, head_env, report, say, start_head, stop_head

from raymoe.cluster.bootstrap import free_port

MAX_TOKENS = 48
CONCURRENCY = 8


def autoscaling_config(gcs: str) -> dict:
    """Cluster-launcher config for the fake multi-node provider (head: 1 CPU; 0-2 emulated GPU workers)."""
    return {
        "cluster_name": "raymoe-autoscaling", "max_workers": 2, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.25,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1, "GPU": 0}, "node_config": {}, "max_workers": 0},
            "gpu_worker": {"resources": {"CPU": 2, "GPU": 1, "object_store_memory": 200 * 2**20},
                           "node_config": {}, "min_workers": 0, "max_workers": 2},
        },
        "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


class Load:
    """A closed loop of ``CONCURRENCY`` clients sending chat completions until :meth:`stop`."""

    def __init__(self, url: str, model: str):
        import httpx

        self.client = httpx.Client(base_url=url, timeout=300)
        self.model = model
        self.results: list[tuple[int, int]] = []  # (status, completion tokens)
        self.in_flight = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CONCURRENCY)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            body = {"model": self.model, "messages": [{"role": "user", "content": f"client {i} request {n}"}],
                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            with self._lock:
                self.in_flight += 1
            try:
                r = self.client.post("/v1/chat/completions", json=body)
                tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
                result = (r.status_code, tokens)
            except Exception as e:  # noqa: BLE001 - a failed request is a finding of the run
                result = (0, 0)
                say(f"request failed: {type(e).__name__}: {e}")
            with self._lock:
                self.in_flight -= 1
                self.results.append(result)
            n += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="rmas.", dir="/tmp"))  # short: Ray's socket paths live under it
    env = head_env(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    passed = False
    gcs = f"127.0.0.1:{free_port()}"
    config = work / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(gcs)))
    head = start_head(work, env, gcs, f"--autoscaling-config={config}", "--num-cpus=1", "--num-gpus=0",
                      "--include-dashboard=false")
    try:
        from raymoe.models.checkpoint import make_checkpoint

        model = str(make_checkpoint("qwen3_moe", work / "qwen3_moe_tiny", seed=0))
        import ray
        from ray import serve

        from raymoe.deploy.serve_app import RaymoeDeployment
        from raymoe.deploy.server_config import ServeOptions

        connect(head, work, gcs)
        say(f"head up at {gcs} (token auth, temp dir {work}): {ray.cluster_resources()}")

        def alive_nodes() -> int:
            return sum(1 for n in ray.nodes() if n["Alive"])

        def replicas() -> dict:
            app = serve.status().applications.get("raymoe")
            if app is None or "raymoe" not in app.deployments:
                return {}
            return dict(app.deployments["raymoe"].replica_states)

        # The deployment options of configs/serve.yaml, made reactive for a short run.
        cfg = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())["applications"][0]
        deployment = dict(cfg["deployments"][0])
        deployment.pop("name")
        deployment["autoscaling_config"] = {**deployment["autoscaling_config"], "target_ongoing_requests": 2,
                                            "upscale_delay_s": 2, "downscale_delay_s": 10,
                                            "metrics_interval_s": 1, "look_back_period_s": 2}
        deployment["ray_actor_options"] = {"num_cpus": 2}
        args = {**cfg["args"], "model": model, "served_model_name": "tiny", "dp_size": 1, "ep_size": 1,
                "enable_tbo": False}
        say(f"deployment options: {deployment}")
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        app = RaymoeDeployment.options(**deployment).bind(ServeOptions(**args).model_dump())
        serve.run(app, name="raymoe", route_prefix="/", blocking=False)

        def watch(until, timeout_s: float, what: str, load: Load | None = None) -> float:
            t0, last = time.monotonic(), 0.0
            while True:
                state, nodes = replicas(), alive_nodes()
                if time.monotonic() - last >= 5:
                    extra = f", requests done {len(load.results)}, in flight {load.in_flight}" if load else ""
                    say(f"  replicas {state}, alive nodes {nodes}{extra}")
                    last = time.monotonic()
                if until(state, nodes):
                    return time.monotonic() - t0
                if time.monotonic() - t0 > timeout_s:
                    raise SystemExit(f"FAILED: {what} not reached within {timeout_s} s (replicas {state}, "
                                     f"nodes {nodes})")
                time.sleep(1)

        took = watch(lambda s, n: s.get("RUNNING") == 1, 300, "first replica running")
        say(f"phase 1: 1 replica running after {took:.0f} s; alive nodes {alive_nodes()} (head + 1 worker)")
        nodes_before = alive_nodes()

        load = Load(f"http://127.0.0.1:{port}", "tiny")
        load.start()
        say(f"phase 2: load, {CONCURRENCY} concurrent chat completions of {MAX_TOKENS} tokens")
        took = watch(lambda s, n: s.get("RUNNING") == 2, 300, "second replica running", load)
        peak_nodes = alive_nodes()
        say(f"2 replicas running after {took:.0f} s of load; alive nodes {peak_nodes}")
        time.sleep(5)  # both replicas serve a little
        load.stop()
        say(f"load stopped: {len(load.results)} requests")

        say("phase 3: idle")
        took = watch(lambda s, n: s.get("RUNNING") == 1 and len(s) == 1, 180, "back to 1 replica")
        say(f"back to 1 replica after {took:.0f} s idle")
        took = watch(lambda s, n: n == nodes_before, 180, "idle worker node removed")
        say(f"idle worker node removed after {took:.0f} s more; alive nodes {alive_nodes()}")

        bad = [r for r in load.results if r != (200, MAX_TOKENS)]
        say(f"requests: {len(load.results)}, all 200 with {MAX_TOKENS} tokens: {not bad} (bad: {bad[:5]})")
        checks = {"replicas went 1 -> 2 -> 1": True, "autoscaler added a node": peak_nodes > nodes_before,
                  "every request completed": not bad and len(load.results) > 0}
        passed = report(checks)
        return 0 if passed else 1
    finally:
        stop_head(head, work, passed, term_rounds=2)

if __name__ == "__main__":
    sys.exit(main())
