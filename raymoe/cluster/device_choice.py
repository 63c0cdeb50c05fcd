"""Which device an engine's ranks compute on: decided once, in the process that starts the engine, before any
actor starts.

``device`` is ``cuda``, ``cpu`` or ``auto``. What counts as evidence depends on where the ranks will run
(:class:`DeviceEvidence`):

* ``process``: the one rank of an offline ``Engine`` computes in this process: ``torch.cuda`` here.
* ``node``: the one rank of a served engine computes in the driver actor, which is placed on this node: the GPUs Ray
  declares on this node (this process may itself be a Ray actor that Ray hides the GPUs from, e.g. a Serve replica).
* ``cluster``: rank actors, anywhere on the Ray cluster: the GPUs the cluster declares, or, when none is up yet,
  the GPUs its autoscaler may add, where the platform publishes its node groups to the GCS (the cluster config Ray
  Data sizes its autoscaling by; the cluster launcher and KubeRay autoscalers of Ray 2.60 publish none, so
  ``configs/cluster.yaml`` and the KubeRay manifest keep one GPU node up from the start).

``cuda`` without any GPU there is refused at once (:func:`choose_device` raises ``InvalidRequestError`` naming
CUDA), never turned into CPU: a user who asked for GPUs and got CPU ranks would only notice from the latency.
``auto`` picks CUDA where GPUs are declared, unless this process's torch is a CPU-only build: then the GPUs are
a cluster's emulated ones (``ray.cluster_utils.Cluster(num_gpus=...)``, what CI runs on) or the front end was
installed without CUDA, and ``auto`` computes on CPU and says why (:attr:`DeviceChoice.reason`). Asking for
``cuda`` on such a cluster is not refused here (the ranks may have another torch build); each rank then refuses
with ``RankDeviceError`` when it sees no GPU (``raymoe.runner.device``), which fails the start within seconds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from raymoe.config import EngineConfig
from raymoe.config.device_defaults import with_device
from raymoe.errors import InvalidRequestError

log = logging.getLogger(__name__)

Scope = Literal["process", "node", "cluster"]


@dataclass(frozen=True)
class DeviceEvidence:
    """What the deciding process knows about GPUs where the ranks will run.

    Attributes:
        scope: ``process``, ``node`` or ``cluster`` (module docstring).
        gpus: GPUs there: ``torch.cuda.device_count()`` for ``process``, Ray's declared ``GPU`` resource of this
            node or of the whole cluster otherwise.
        torch_cuda_built: whether this process's torch is a CUDA build (``torch.backends.cuda.is_built()``).
        torch_version: ``torch.__version__`` (named in messages).
        autoscaler_gpus: GPUs the cluster's autoscaler may add (its published node groups: ``max_count`` x GPUs
            per node, ``cluster`` scope only; 0 when it publishes none or has no GPU group).
    """

    scope: Scope
    gpus: float
    torch_cuda_built: bool
    torch_version: str = "?"
    autoscaler_gpus: float = 0.0

    @property
    def where(self) -> str:
        return {"process": "this process", "node": "this Ray node", "cluster": "the Ray cluster"}[self.scope]

    def found(self) -> str:
        """What was found, for the reason and the error ("the Ray cluster declares 0 GPU(s)" ...)."""
        text = f"{self.where} {'sees' if self.scope == 'process' else 'declares'} {self.gpus:g} GPU(s)"
        if self.gpus < 1 and self.autoscaler_gpus >= 1:
            text += f" and its autoscaler may add {self.autoscaler_gpus:g}"
        return text


@dataclass(frozen=True)
class DeviceChoice:
    """The resolved device and why (one line for the start-up console)."""

    device: str
    reason: str


def choose_device(requested: str, evidence: DeviceEvidence, world_size: int = 1) -> DeviceChoice:
    """Decide the ranks' device from the ``device`` option and the evidence (module docstring).

    Args:
        requested: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        evidence: GPUs where the ranks will run. world_size: ranks of the engine (each takes one GPU on CUDA).
    Raises:
        InvalidRequestError: ``cuda`` requested where no GPU is declared or visible (field ``device``; the message
            names CUDA and the GPUs found).
        ValueError: an unknown ``requested``.
    """
    if requested == "cpu":
        return DeviceChoice("cpu", "device cpu (requested)")
    if requested not in ("auto", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {requested!r}")
    gpus = max(evidence.gpus, evidence.autoscaler_gpus)
    found = evidence.found()
    if requested == "cuda":
        if gpus < 1:
            hint = ("torch.cuda.is_available() is False" if evidence.scope == "process"
                    else "Ray's GPU resource is 0 and no autoscaler publishes a GPU node group: start Ray on GPU "
                         "nodes, join a GPU cluster with --address, or keep one GPU node up")
            raise InvalidRequestError("device", f"cuda was requested but {found} ({hint}; torch "
                                                f"{evidence.torch_version}); use device cpu to compute on CPU")
        short = f"; {world_size} ranks wait for one GPU each" if evidence.scope == "cluster" and gpus < world_size \
            else ""
        return DeviceChoice("cuda", f"device cuda (requested; {found}{short})")
    if gpus >= 1 and evidence.torch_cuda_built:
        return DeviceChoice("cuda", f"device cuda (auto: {found})")
    if gpus >= 1:
        return DeviceChoice("cpu", f"device cpu (auto: {found}, but torch {evidence.torch_version} here is not a CUDA "
                                   "build, so they are treated as emulated; pass device cuda to insist)")
    return DeviceChoice("cpu", f"device cpu (auto: {found})")


def gather_evidence(scope: Scope) -> DeviceEvidence:
    """Read the GPUs of ``scope`` (Ray must be initialized for ``node`` and ``cluster``)."""
    import torch

    built, version = torch.backends.cuda.is_built(), torch.__version__
    if scope == "process":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return DeviceEvidence("process", gpus, built, version)
    import ray

    if scope == "cluster":
        return DeviceEvidence("cluster", ray.cluster_resources().get("GPU", 0.0), built, version,
                              autoscaler_gpus())
    here = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == here and n["Alive"]), None)
    return DeviceEvidence("node", (node or {}).get("Resources", {}).get("GPU", 0.0), built, version)


def autoscaler_gpus() -> float:
    """GPUs the Ray cluster's autoscaler may add: the sum over the node groups it published to the GCS of
    ``max_count`` x GPUs per node (``ray._private.state.state.get_max_resources_from_cluster_config``, what Ray Data
    sizes its autoscaling by; unbounded groups count as 2**31). 0 when nothing is published (no autoscaler, or one
    that publishes nothing, as the cluster launcher's and KubeRay's of Ray 2.60) or that private API is missing."""
    try:
        from ray._private.state import state

        published = state.get_max_resources_from_cluster_config()
    except Exception:  # a Ray without it, or a GCS that refuses the read: no autoscaler evidence
        log.debug("no autoscaler cluster config", exc_info=True)
        return 0.0
    return float(min((published or {}).get("GPU", 0) or 0, 2**31))


def resolve_engine_config(config: EngineConfig, serving: bool) -> tuple[EngineConfig, DeviceChoice]:
    """Decide ``config``'s device and with it every per-device default (``raymoe.config.device_defaults``).

    Call it once, in the process that starts the engine and before any of its actors starts. A world of more
    than one rank joins Ray here (``config.ray_address``) to read the cluster's GPUs.

    Args:
        serving: the engine is served (the driver actor on this node holds a one-rank world's rank); False for
            the offline ``Engine`` (a one-rank world computes in this process).
    Returns:
        the resolved config (``config.resolved`` is True) and the choice with its reason.
    Raises:
        InvalidRequestError: ``cuda`` without GPUs (names CUDA), or a decided default the config refuses (a GPU
            backend on CPU ...).
    """
    world = config.parallel.world_size
    if config.device == "cpu":
        choice = choose_device("cpu", DeviceEvidence("process", 0, False))
    else:
        if world > 1 or serving:
            from raymoe.cluster.bootstrap import init_ray

            init_ray(config.ray_address)
        scope: Scope = "cluster" if world > 1 else ("node" if serving else "process")
        choice = choose_device(config.device, gather_evidence(scope), world)
    log.info("%s", choice.reason)
    return with_device(config, choice.device, serving=serving), choice
