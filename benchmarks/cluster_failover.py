"""Node failover of a dp=2 x tp=2 engine on a local multi-node Ray cluster (a script, not a test: about 2-3
minutes on 2 cores, and it removes nodes, which the test session's shared cluster must keep).

The cluster is ``ray.cluster_utils.Cluster`` on 127.0.0.1: a head without GPUs and three worker nodes that
declare 2 GPUs each (no CUDA behind them: the ranks compute on CPU but reserve GPU bundles, so each TP group fills
one worker node, as on a real GPU cluster). The engine runs behind ``DriverService``, the same supervised loop
that ``raymoe serve`` and the Serve app drive. Phases:

1. serve four long requests; remove the worker node of DP group 1 while they decode -> every in-flight request
   ends with an ``unhealthy`` error, health says the rank group is restarting;
2. the group is rebuilt on the two remaining worker nodes (never the head) and answers greedy requests with the
   single-rank tokens;
3. remove one more worker node -> one GPU node is left, too small for the 4 GPU bundles: a request fails, and
   health says why the group cannot be rebuilt (the placement timeout, with the bundles it asked for);
4. add a worker node -> the next restart attempt places the group and the engine serves again.

Run:  PYTHONPATH=. python benchmarks/cluster_failover.py   (exit status 0 when every check holds)
"""

from __future__ import annotations

import os
import sys
import time

from raymoe.cluster.bootstrap import free_port  # does not import ray

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on 127.0.0.1 (before importing ray)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Foo(object):\n    pass\n", "x = [i * i for i in"]
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def worker_args() -> dict:
    return {"num_cpus": 2, "num_gpus": 2, "dashboard_agent_listen_port": free_port(),
            "metrics_export_port": free_port()}


class Collector:
    """``DriverService`` publish target: per-request deltas."""

    def __init__(self):
        self.deltas: dict[str, list] = {}

    def __call__(self, batch) -> None:
        for d in batch:
            self.deltas.setdefault(d.request_id, []).append(d)

    def last(self, rid: str):
        ds = self.deltas.get(rid)
        return ds[-1] if ds and ds[-1].finished else None

    def tokens(self, rid: str) -> list[int]:
        return [t for d in self.deltas.get(rid, ()) for t in d.token_ids]


def wait(predicate, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"FAILED: {what} not reached within {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - t0


def check(cond: bool, what: str) -> None:
    say(("ok   " if cond else "FAIL ") + what)
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def main() -> int:
    import ray
    from ray.cluster_utils import Cluster

    from raymoe import Engine, SamplingParams
    from raymoe.actors import factory
    from raymoe.actors.driver_service import AddRequest, DriverService
    from raymoe.models.checkpoint import make_checkpoint

    model = str(make_checkpoint("qwen3_moe", "/tmp/raymoe-failover/qwen3_moe_tiny", seed=0))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    with Engine(model) as single:  # in-process single rank: the reference tokens
        reference = [o.token_ids for o in single.generate(PROMPTS[:2], greedy)]

    class QuickPlacementExecutor(factory.RayExecutor):
        """The production executor, giving up placement after 20 s instead of 180 s, so phase 3 reports
        quickly."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "init_timeout_s": 20.0})

    factory.RayExecutor = QuickPlacementExecutor
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "include_dashboard": False, "gcs_server_port": free_port(),
        "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port()})
    service = engine = None
    try:
        workers = [cluster.add_node(**worker_args()) for _ in range(3)]
        ray.init(address=cluster.address)
        say(f"cluster up: head + {len(workers)} worker nodes x 2 GPUs (emulated), {ray.cluster_resources()}")
        # One (emulated) GPU per rank in its bundle, CPU compute (the nodes declare GPUs but have no CUDA).
        engine = Engine(model, tp_size=2, dp_size=2, ep_size=4, device="cpu", bundle_gpus=True)
        by_id = {w.node_id: w for w in workers}

        def rank_nodes() -> list[str]:
            return ray.get([w.node_id.remote() for w in engine.driver.executor.workers])

        nodes = rank_nodes()
        say(f"ranks 0-3 on nodes {[n[:8] for n in nodes]}")
        check(nodes[0] == nodes[1] != nodes[2] == nodes[3] and set(nodes) <= by_id.keys(),
              "each TP group on its own GPU worker node")

        out = Collector()
        service = DriverService(engine.driver, publish=out)
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        service.submit([AddRequest(f"r{i}", engine.encode(p), long) for i, p in enumerate(PROMPTS)])
        wait(lambda: service.driver.num_steps >= 5, 60, "5 decode steps")

        # Phase 1: lose the node of DP group 1 mid-decode.
        victim = by_id[nodes[2]]
        say(f"phase 1: removing worker node {victim.node_id[:8]} (DP group 1) at step {service.driver.num_steps}")
        cluster.remove_node(victim)
        took = wait(lambda: all(out.last(f"r{i}") for i in range(4)), 120, "in-flight requests ended")
        errors = [out.last(f"r{i}").error for i in range(4)]
        say(f"in-flight requests ended {took:.1f} s after the removal: {[(e.kind, e.message) for e in errors]}")
        check(all(e is not None and e.kind == "unhealthy" for e in errors), "every in-flight request: unhealthy")
        say(f"health while recovering: {service.health_detail()!r}")

        # Phase 2: rebuilt on the two remaining worker nodes.
        took = wait(service.healthy, 180, "healthy after the rebuild")
        nodes = rank_nodes()
        say(f"phase 2: healthy again after {took:.1f} s (rank restarts {service.rank_restarts}); "
            f"ranks on {[n[:8] for n in nodes]}")
        alive = {w.node_id for w in workers if w is not victim}
        check(nodes[0] == nodes[1] != nodes[2] == nodes[3] and set(nodes) == alive,
              "rebuilt group spans the two surviving worker nodes")
        service.submit([AddRequest(f"after{i}", engine.encode(p), greedy) for i, p in enumerate(PROMPTS[:2])])
        wait(lambda: out.last("after0") and out.last("after1"), 60, "requests after the rebuild")
        check([out.tokens("after0"), out.tokens("after1")] == reference, "greedy tokens equal the single rank's")

        # Phase 3: one GPU node left; the 4-GPU group cannot be placed.
        second = by_id[nodes[0]]
        say(f"phase 3: removing worker node {second.node_id[:8]}; 2 GPUs remain for 4 GPU bundles")
        cluster.remove_node(second)
        service.submit([AddRequest("doomed", engine.encode(PROMPTS[0]), long)])
        wait(lambda: out.last("doomed"), 120, "the request on the broken group ended")
        say(f"request ended with {out.last('doomed').error}")
        say(f"health at once: {service.health_detail()!r}")
        took = wait(lambda: "could not place" in service.health_detail(), 120, "health reports the failed rebuild")
        say(f"health {took:.1f} s later: {service.health_detail()!r}")
        check(not service.healthy(), "health says the group does not fit")

        # Phase 4: capacity comes back.
        added = cluster.add_node(**worker_args())
        say(f"phase 4: added worker node {added.node_id[:8]}")
        took = wait(service.healthy, 180, "healthy after capacity returned")
        nodes = rank_nodes()
        say(f"healthy again after {took:.1f} s; ranks on {[n[:8] for n in nodes]}")
        service.submit([AddRequest("back", engine.encode(PROMPTS[0]), greedy)])
        wait(lambda: out.last("back"), 60, "request after capacity returned")
        check(out.tokens("back") == reference[0], "greedy tokens equal the single rank's")
        say(f"rank-group restarts: {service.rank_restarts}")
        say("PASS")
        return 0
    finally:
        if service is not None:
            service.shutdown()
        if engine is not None:
            engine.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
