"""Ray start-up: join an existing cluster (``address``) or start a local one bound to loopback."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None, min_cpus: int = 8) -> None:
    """Connect to Ray once per process.

    Args:
        address: ``ray://host:port`` / ``host:port`` of a running cluster, ``"auto"``, or None to start a local
            single-node cluster on 127.0.0.1.
        num_cpus: logical CPUs of a local cluster; default ``max(os.cpu_count(), min_cpus)`` so that a world of
            several CPU ranks can be placed on a small machine (ranks are mostly waiting on each other).
    """
    if not address:
        # A local cluster lives on loopback: Ray reads this before choosing its node address (it must be set
        # before ray is imported), and gloo binds its sockets to ``lo``.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    cpus = num_cpus or max(os.cpu_count() or 1, min_cpus)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False)
    log.info("started a local Ray cluster with %d logical CPUs", cpus)
