"""Ray start-up: join an existing cluster (``address``) or start a local one bound to loopback.

A local cluster started by raymoe listens on 127.0.0.1 only: its GCS, raylet, object manager, dashboard agent,
runtime-env agent and workers all bind the node address, and raymoe makes that address the loopback one. Ray
decides this when ``ray`` is first imported (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes every local node use
the loopback address, as Ray does on macOS and Windows), so :func:`use_loopback_environment` must run before any
``import ray`` in the process: the ``raymoe`` command does it first thing. gloo's sockets follow
``GLOO_SOCKET_IFNAME=lo``. No dashboard is started. Ray's token authentication is left as Ray sets it up (on by
default for a new local cluster since Ray 2.52; ``RAY_AUTH_MODE`` overrides it).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

log = logging.getLogger(__name__)

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
"""Environment of a process that starts a loopback-only local Ray cluster (values the user set are kept)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; another process may take it before the
    caller binds it, which the callers' start-up errors then report)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def use_loopback_environment() -> None:
    """Set :data:`LOOPBACK_ENV` (where unset) for this process and the Ray processes it will start.

    Call it before ``ray`` is imported; once imported, Ray has already chosen its node address.
    """
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)


def ray_imported_too_early() -> bool:
    """Whether ``ray`` was imported in this process before the loopback environment was in force (a local
    cluster it starts would then listen on the machine's network address)."""
    constants = sys.modules.get("ray._private.ray_constants")
    return constants is not None and bool(getattr(constants, "ENABLE_RAY_CLUSTER", False))


def init_ray(address: str | None = None, num_cpus: int | None = None, min_cpus: int = 8) -> None:
    """Connect to Ray once per process.

    Args:
        address: ``ray://host:port`` / ``host:port`` of a running cluster, ``"auto"``, or None to start a local
            single-node cluster on 127.0.0.1 (see the module docstring).
        num_cpus: logical CPUs of a local cluster; default ``max(os.cpu_count(), min_cpus)`` so that a world of
            several CPU ranks can be placed on a small machine (ranks are mostly waiting on each other).
    """
    if not address:
        use_loopback_environment()
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    if ray_imported_too_early():
        log.warning("ray was imported before raymoe set %s, so the local Ray cluster will listen on this machine's "
                    "network address, not only on 127.0.0.1: set them before importing ray (the raymoe command "
                    "does)", ", ".join(LOOPBACK_ENV))
    cpus = num_cpus or max(os.cpu_count() or 1, min_cpus)
    # worker_niceness 0: the raylet starts workers at nice 15 by default, which would put the driver and rank actors
    # behind the HTTP front end and the clients (raymoe.actors.process_tuning.set_engine_process_nice)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, _system_config={"worker_niceness": 0})
    log.info("started a local Ray cluster on 127.0.0.1 with %d logical CPUs", cpus)
