"""A rolling update of the raymoe Serve app with ``serve deploy``, under 32 streaming clients, on a local Ray
cluster (a script, not a test: about 2 minutes on 2 cores; ``tests/test_serve_rolling.py`` runs the same update
through the Python API in CI).

What it runs:

* A Ray head (``ray start --head --block``) on 127.0.0.1 with its own ``--temp-dir``, free ports, token
  authentication (a random token in the environment) and the dashboard on 127.0.0.1, which ``serve deploy``
  talks to; it is stopped by its process id, and any leftover process of its temp dir by id.
* ``serve deploy`` of ``configs/serve.yaml`` (its deployment options as they are: rolling-update surge, graceful
  shutdown, autoscaling 1-2 replicas) with a tiny seeded checkpoint at ``dp_size=1``, ``max_running_requests``
  16 and ``max_context_len`` 1024; then, under load, ``serve deploy`` of the same file with
  ``max_running_requests`` 24 and ``max_context_len`` 2048 (a compatible change: every client request stays valid).
* 32 clients, each streaming completions of 48 tokens back to back, and a poller of ``/v1/models`` every 0.2 s.

Checks: every stream ends with ``[DONE]`` and 48 tokens (no error event, no cut connection), every poll answers,
the replica actors after the update are all new, ``/v1/models`` answers the new ``max_model_len`` at the end, and
no stream sent during the update waited more than 6 s for its first token (no moment without a replica).

Run:  PYTHONPATH=. python benchmarks/serve_rolling_update.py   (exit status 0 when every check holds)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from ray_head import ROOT, connect, head_env, report, say, start_head, stop_head

from raymoe.cluster.bootstrap import free_port

CLIENTS = 32
MAX_TOKENS = 48
MAX_TTFT_DURING_UPDATE_S = 6.0


def write_config(path: Path, model: str, port: int, max_running: int, max_context: int) -> Path:
    """configs/serve.yaml with the tiny model at dp=1, the given limits and the given HTTP port."""
    cfg = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["args"].update({"model": model, "served_model_name": "tiny", "dp_size": 1, "ep_size": 1,
                        "enable_tbo": False, "max_running_requests": max_running, "max_context_len": max_context})
    path.write_text(yaml.safe_dump(cfg))
    return path


class Load:
    """``CLIENTS`` streaming clients and a ``/v1/models`` poller on an event loop of their own, until :meth:`stop`."""

    def __init__(self, url: str):
        self.url = url
        self.streams: list[dict] = []
        self.models: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _stream(self, c) -> dict:
        body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        out = {"sent": time.monotonic(), "first": None, "tokens": None, "done": False, "errors": [], "failure": None}
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    out["failure"] = f"HTTP {r.status_code}"
                    return out
                async for line in r.aiter_lines():
                    data = line[6:] if line.startswith("data: ") else None
                    if data == "[DONE]":
                        out["done"] = True
                    elif data:
                        event = json.loads(data)
                        if "error" in event:
                            out["errors"].append(event["error"]["code"])
                        elif event.get("usage") and not event.get("choices"):
                            out["tokens"] = event["usage"]["completion_tokens"]
                        else:
                            out["first"] = out["first"] or time.monotonic()
        except Exception as e:  # noqa: BLE001 - a failed request is a finding of the run
            out["failure"] = type(e).__name__
        return out

    async def _client(self, c) -> None:
        while not self._stop.is_set():
            self.streams.append(await self._stream(c))

    async def _poll(self, c) -> None:
        while not self._stop.is_set():
            try:
                r = await c.get("/v1/models")
                self.models.append(r.json()["data"][0]["max_model_len"] if r.status_code == 200 else r.status_code)
            except Exception as e:  # noqa: BLE001
                self.models.append(type(e).__name__)
            await asyncio.sleep(0.2)

    async def _main(self) -> None:
        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=300,
                                     limits=httpx.Limits(max_connections=CLIENTS + 4)) as c:
            await asyncio.gather(self._poll(c), *(self._client(c) for _ in range(CLIENTS)))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=300)


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="rmru.", dir="/tmp"))  # short: Ray's socket paths live under it
    env = head_env()
    passed = False
    gcs, dash = f"127.0.0.1:{free_port()}", free_port()
    dashboard = f"http://127.0.0.1:{dash}"
    head = start_head(work, env, gcs, "--num-cpus=4", "--num-gpus=0", "--include-dashboard=true",
                      "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}")
    try:
        from raymoe.models.checkpoint import make_checkpoint

        model = str(make_checkpoint("qwen3_moe", work / "qwen3_moe_tiny", seed=0))
        import ray
        from ray import serve

        connect(head, work, gcs, log_to_driver=False)
        say(f"head up at {gcs}, dashboard {dashboard} (token auth, temp dir {work})")
        port = free_port()
        v1 = write_config(work / "serve-v1.yaml", model, port, 16, 1024)
        v2 = write_config(work / "serve-v2.yaml", model, port, 24, 2048)

        def deploy(path: Path) -> None:
            for _ in range(30):  # the dashboard's Serve endpoint comes up shortly after the head
                r = subprocess.run(["serve", "deploy", str(path), "-a", dashboard], env=env, capture_output=True,
                                   text=True)
                if r.returncode == 0:
                    say(f"serve deploy {path.name}: accepted")
                    return
                time.sleep(2)
            raise SystemExit(f"FAILED: serve deploy {path.name}: {r.stderr[-1000:]}")

        def app_state() -> tuple[str, dict]:
            app = serve.status().applications.get("raymoe")
            if app is None:
                return "NONE", {}
            deployment = app.deployments.get("raymoe")
            return getattr(app.status, "value", str(app.status)), dict(deployment.replica_states if deployment else {})

        def replica_actors() -> set[str]:
            return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::raymoe#")}

        deploy(v1)
        t = time.monotonic()
        while app_state()[0] != "RUNNING":
            if time.monotonic() - t > 300:
                raise SystemExit(f"FAILED: the app did not start: {app_state()}")
            time.sleep(1)
        before = replica_actors()
        say(f"v1 running after {time.monotonic() - t:.0f} s: replicas {sorted(before)}")

        load = Load(f"http://127.0.0.1:{port}")
        load.start()
        while len(load.streams) < CLIENTS:
            time.sleep(0.2)
        say(f"load: {CLIENTS} clients streaming completions of {MAX_TOKENS} tokens; {len(load.streams)} done")
        updating = time.monotonic()
        deploy(v2)
        last = 0.0
        while before & replica_actors() or app_state()[0] != "RUNNING":
            if time.monotonic() - last >= 2:
                state, replicas = app_state()
                say(f"  app {state}, replicas {replicas}, streams done {len(load.streams)}")
                last = time.monotonic()
            if time.monotonic() - updating > 400:
                raise SystemExit(f"FAILED: the update did not finish: {app_state()}")
            time.sleep(0.2)
        after = replica_actors()
        say(f"v2 running, old replica gone after {time.monotonic() - updating:.1f} s: replicas {sorted(after)}")
        time.sleep(3)
        load.stop()

        s = load.streams
        bad = [x for x in s if not (x["done"] and x["tokens"] == MAX_TOKENS and not x["errors"] and not x["failure"])]
        during = [x["first"] - x["sent"] for x in s if x["first"] and x["sent"] >= updating]
        polls_bad = [m for m in load.models if not isinstance(m, int)]
        say(f"streams: {len(s)} ({len(during)} sent during or after the update), failed {len(bad)} {bad[:3]}")
        say(f"time to first token of those: max {max(during):.2f} s, median {sorted(during)[len(during) // 2]:.2f} s")
        say(f"/v1/models: {len(load.models)} polls, max_model_len {load.models[0]} -> {load.models[-1]}, "
            f"failed {len(polls_bad)}")
        checks = {"0 failed requests": not bad and len(s) > 2 * CLIENTS,
                  "every /v1/models poll answered": not polls_bad,
                  "replicas replaced": bool(after) and not after & before,
                  "new config in effect (max_model_len 2048)": load.models[-1] == 2048,
                  f"no stream waited over {MAX_TTFT_DURING_UPDATE_S:g} s for its first token":
                      max(during) < MAX_TTFT_DURING_UPDATE_S}
        passed = report(checks)
        return 0 if passed else 1
    finally:
        stop_head(head, work, passed)

if __name__ == "__main__":
    sys.exit(main())
