"""Shared fixtures: one seeded tiny Qwen3-MoE checkpoint per test session."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Keep every Ray process and gloo socket of the test session on loopback (read by Ray when it is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# `make mutation` runs the unit tests once per mutant with `--hypothesis-profile=mutation`: every run draws the same
# examples (derandomized) and no failing example of one mutant is replayed against the next (no database), so a
# mutant's verdict does not depend on the order the mutants ran in.
settings.register_profile("mutation", derandomize=True, database=None)



@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 4-layer, hidden-128, 8-expert (top-2) Qwen3-MoE folder with a trained BPE tokenizer (seed 0)."""
    from raymoe.models.checkpoint import make_checkpoint

    return str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe_tiny", seed=0))


#: How often the session fixture tries to start one Ray node before it gives up. Ray waits a fixed 30 s for a new
#: raylet to register with the GCS; on a loaded two-core CI machine (or when a port picked by :func:`free_port` is
#: taken before Ray binds it) one start can miss that window, which once failed every Ray test of a CI run.
NODE_START_ATTEMPTS = 3


def _start_node(start, what: str):
    """Run ``start()`` (which starts one Ray node and returns its result), retrying up to :data:`NODE_START_ATTEMPTS`
    times. Before a retry, the processes the failed attempt left behind (new children of this process, with their own
    children) are killed, and the tail of the newest raylet logs is printed so a CI log shows why the node failed.

    Raises:
        Exception: the last attempt's error when every attempt failed.
    """
    import contextlib
    import glob
    import sys

    import psutil

    me = psutil.Process()
    for attempt in range(1, NODE_START_ATTEMPTS + 1):
        before = {p.pid for p in me.children()}
        try:
            return start()
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception on a start-up timeout
            if attempt == NODE_START_ATTEMPTS:
                raise
            print(f"[conftest] starting {what} failed (attempt {attempt}): {exc}", file=sys.stderr)
            for log in sorted(glob.glob("/tmp/ray/session_latest/logs/raylet*"), key=os.path.getmtime)[-2:]:
                with open(log, errors="replace") as f:
                    print(f"[conftest] tail of {log}:\n" + "".join(f.readlines()[-15:]), file=sys.stderr)
            # The processes this attempt started (direct children that are new: its raylet ...) and theirs; the
            # worker processes that earlier nodes' raylets start meanwhile are left alone.
            leftovers = [p for p in me.children() if p.pid not in before]
            for p in list(leftovers):
                with contextlib.suppress(psutil.NoSuchProcess):
                    leftovers += p.children(recursive=True)
            for p in leftovers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(leftovers, timeout=10)


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray instance for the whole session: three nodes that each declare 2 GPUs (``ray.cluster_utils.Cluster``;
    the head also has 8 logical CPUs, the workers 2), all on 127.0.0.1; CPU-only worlds place anywhere. Each node's
    start is retried (:func:`_start_node`)."""
    import ray
    from ray.cluster_utils import Cluster

    from raymoe.cluster.bootstrap import free_port

    # Free ports everywhere, so the suite can run beside another Ray instance on the same machine; fresh ones on
    # every attempt.
    cluster = _start_node(lambda: Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "num_gpus": 2, "include_dashboard": False, "gcs_server_port": free_port(),
        "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port()}), "the head node")
    for i in range(2):
        _start_node(lambda: cluster.add_node(num_cpus=2, num_gpus=2, dashboard_agent_listen_port=free_port(),
                                             metrics_export_port=free_port()), f"worker node {i + 1}")
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def temporary_nodes(ray_cluster):
    """A context manager that adds nodes to the session cluster and removes them on exit:
    ``with temporary_nodes(num_gpus=8, count=2) as node_ids:`` (hex ids, in the order added). Each node declares
    ``num_gpus`` GPUs and ``num_cpus`` logical CPUs (default 2) on 127.0.0.1; its start is retried
    (:func:`_start_node`). On exit the nodes' processes are killed and the test waits until the GCS reports them
    dead, so later tests see the session's three nodes only."""
    import contextlib
    import time

    import ray

    from raymoe.cluster.bootstrap import free_port

    @contextlib.contextmanager
    def add(num_gpus: int, count: int, num_cpus: int = 2):
        nodes = []
        try:
            for i in range(count):
                nodes.append(_start_node(lambda: ray_cluster.add_node(
                    num_cpus=num_cpus, num_gpus=num_gpus, dashboard_agent_listen_port=free_port(),
                    metrics_export_port=free_port()), f"temporary node {i + 1}"))
            yield [n.node_id for n in nodes]
        finally:
            for n in nodes:
                ray_cluster.remove_node(n)
            ids = {n.node_id for n in nodes}
            deadline = time.monotonic() + 60
            while any(n["Alive"] for n in ray.nodes() if n["NodeID"] in ids) and time.monotonic() < deadline:
                time.sleep(0.2)

    return add
