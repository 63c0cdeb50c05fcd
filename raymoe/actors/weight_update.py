"""Weight updates from disk: the served model switches to another checkpoint folder of the same architecture without
a restart, as a reinforcement-learning loop needs between rollouts (SGLang's ``update_weights_from_disk``; verl and
slime drive SGLang's over HTTP).

What one update does, on the driver's loop thread, with no request and no step in flight
(``DriverService`` pauses for it: new requests are held; running ones finish, are aborted, or are retracted: ended
with a ``"retracted"`` error that the front end answers by submitting them again with the tokens they delivered,
held like new ones, so their streams pause and go on with the new weights, SGLang's "retract" pause):

1. refuse a folder of another architecture (``raymoe.config.model_compat.check_same_architecture``, naming the
   field) or a world shrunk after a fault: nothing changes;
2. flush every DP group's radix cache (see 4); drop the moves of an expert rebalance not sent yet
   (``EplbController.abort``, as a driver reset does): the committed placement is what every rank holds and what the
   load reads;
3. every rank loads the folder into its tensors in place, all at once (``RankWorker.update_weights_from_disk``);
   when one fails half-way the world loads the previous folder again, and when that fails too the engine is
   unhealthy and its ranks are rebuilt (from the previous folder);
4. the executor keeps the new folder for rebuilds after a fault. Every DP group's radix cache was flushed before the
   load (its KV was computed with the old weights; nothing is cached between the flush and the load, as this thread
   owns the driver), so a group that cannot flush (KV held for the other engine of a PD pair) refuses the update
   before any weight changes.

A driver actor that Ray restarts starts from its ``EngineConfig`` again, so with the configured folder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from raymoe.config.model import ModelConfig
from raymoe.config.model_compat import check_same_architecture
from raymoe.errors import CheckpointError, EngineUnhealthyError

DEFAULT_WEIGHT_VERSION = "default"
"""The weight version an engine reports before its first update (SGLang's default)."""


@dataclass(frozen=True)
class WeightUpdate:
    """A request to serve another checkpoint folder's weights (SGLang's ``UpdateWeightFromDiskReqInput`` fields).

    Attributes:
        model_path: a Hugging Face model folder of the served architecture (same ``config.json`` sizes).
        weight_version: the name the engine reports for the new weights (``/get_weight_version``, stats); None:
            the previous name is kept.
        abort_all_requests: end the requests in flight (``finish_reason`` ``"abort"``) instead of waiting for them
            to finish.
        retract_requests: take the requests in flight off the engine instead (their KV freed); the front end
            submits each again with the tokens it delivered, and it goes on with the new weights (the client sees a
            pause). The offline ``Engine`` has none in flight.
        timeout_s: bound on the wait for the requests in flight to finish, seconds (the load itself is bounded by
            the ranks' own timeouts); past it the update is refused and nothing changes.
    Raises:
        ValueError: an empty path or version, a timeout that is not positive, or both ``abort_all_requests`` and
            ``retract_requests``.
    """

    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    timeout_s: float = 300.0
    retract_requests: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError("model_path must be a non-empty folder path")
        if self.weight_version is not None and (not isinstance(self.weight_version, str) or not self.weight_version):
            raise ValueError("weight_version must be a non-empty string or None")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.abort_all_requests and self.retract_requests:
            raise ValueError("abort_all_requests and retract_requests: the requests in flight are either aborted or "
                             "retracted")


@dataclass(frozen=True)
class WeightUpdateResult:
    """How an update ended.

    Attributes:
        success: the new weights serve. message: what happened (on failure: why, naming the field or tensor).
        weight_version: the version serving after the call. seconds: the ranks' load time, seconds (0 when none
        loaded). num_aborted_requests: requests ended by ``abort_all_requests``. num_retracted_requests: requests
        retracted (``retract_requests``). param: on failure, the request
        field at fault (``"model_path"``: another architecture or a folder that would not load; ``"timeout_s"``:
        requests still in flight at the deadline), None when the engine's state refused it (another update in
        progress, a shrunk world, a fault).
    """

    success: bool
    message: str
    weight_version: str
    seconds: float = 0.0
    num_aborted_requests: int = 0
    param: str | None = None
    num_retracted_requests: int = 0


def call_ranks(executor, method: str, *args, timeout_s: float) -> list:
    """Call ``RankWorker.<method>(*args)`` on every rank of ``executor`` at once and wait for all: rank actors
    (``RayExecutor``, also under a ``HostedDriver``'s ``GroupHosts``), or the one rank of a ``LocalExecutor`` on
    its rank thread. Raises what a rank raised (a Ray task error wraps it), or ray's ``GetTimeoutError``."""
    ranks = getattr(executor, "ranks", executor)
    workers = list(getattr(ranks, "workers", None) or [])
    if not workers:
        return [ranks.call_rank(method, *args)]
    import ray

    return ray.get([getattr(w, method).remote(*args) for w in workers], timeout=timeout_s)


def _served_path(executor) -> str:
    return getattr(executor, "ranks", executor).runner_cfg.model_path


def _keep_path(executor, model_path: str) -> None:
    """Rebuilds of the ranks after a fault (restart, elastic grow) load ``model_path`` from now on."""
    ranks = getattr(executor, "ranks", executor)
    ranks.runner_cfg = replace(ranks.runner_cfg, model_path=model_path)
    if getattr(ranks, "initial_cfg", None) is not None:
        ranks.initial_cfg = replace(ranks.initial_cfg, model_path=model_path)


def _cause(e: BaseException) -> str:
    """A rank's error as the caller should read it (Ray wraps it in a task error whose ``cause`` is the original)."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {cause}"


def apply_weight_update(driver, served: ModelConfig, update: WeightUpdate, version: str,
                        load_timeout_s: float = 600.0) -> WeightUpdateResult:
    """Switch ``driver``'s ranks to ``update.model_path`` (module docstring); the driver must be idle.

    Args:
        driver: a ``Driver`` or ``HostedDriver`` with no request or step in flight.
        served: the served architecture. version: the weight version serving now.
        load_timeout_s: bound on the ranks' load (and on loading the previous folder again), seconds.
    Returns:
        the result; a refusal or a failed load rolled back changes nothing.
    Raises:
        RuntimeError: the driver is not idle. EngineUnhealthyError: the load failed and loading the previous
            folder failed too (the caller rebuilds the ranks).
    """
    if driver.has_unfinished():
        raise RuntimeError("apply_weight_update needs an idle driver")
    try:
        check_same_architecture(served, update.model_path)
    except CheckpointError as e:
        return WeightUpdateResult(False, str(e), version, param="model_path")
    except (OSError, ValueError) as e:  # a path the OS refuses (a NUL byte, too long)
        return WeightUpdateResult(False, f"{update.model_path!r}: {type(e).__name__}: {e}", version,
                                  param="model_path")
    executor = driver.executor
    ranks = getattr(executor, "ranks", executor)
    if getattr(ranks, "vacant", None):
        return WeightUpdateResult(False, "the rank group runs shrunk after a fault; update the weights once it has "
                                         "grown back (/health)", version)
    try:  # first: nothing is inserted meanwhile (this thread owns the driver), and a refusal changes no weight
        driver.flush_cache()
    except RuntimeError as e:  # KV held for the other engine of a PD pair
        return WeightUpdateResult(False, f"the radix cache cannot be flushed now ({e}); retry", version)
    if driver.eplb is not None and driver.eplb.moving:
        driver.eplb.abort()
    previous = _served_path(executor)
    t0 = time.perf_counter()
    try:
        call_ranks(executor, "update_weights_from_disk", update.model_path, timeout_s=load_timeout_s)
    except Exception as e:  # noqa: BLE001 - any rank's failure: load the previous folder on every rank
        why = _cause(e)
        try:
            call_ranks(executor, "update_weights_from_disk", previous, timeout_s=load_timeout_s)
        except Exception as again:  # noqa: BLE001 - the ranks hold a mix: they are rebuilt
            raise EngineUnhealthyError(f"loading {update.model_path} failed ({why}) and loading {previous} again "
                                       f"failed too ({_cause(again)})") from again
        return WeightUpdateResult(False, f"loading {update.model_path} failed ({why}); the ranks serve {previous} "
                                         "again", version, time.perf_counter() - t0, param="model_path")
    seconds = time.perf_counter() - t0
    _keep_path(executor, update.model_path)
    new_version = update.weight_version or version
    return WeightUpdateResult(True, f"serving {update.model_path} (version {new_version!r}); radix cache flushed",
                              new_version, seconds)


@dataclass
class PendingWeightUpdate:
    """An update the driver's loop waits to apply (``DriverService.update_weights``): it holds new requests until
    the requests in flight are done (or aborted), then applies the update and admits what it held.

    Attributes:
        update: what was asked. served: the served architecture. future: answered with the
        ``WeightUpdateResult``. load_timeout_s: bound on the ranks' load, seconds. deadline: ``time.monotonic()``
        past which the wait gives up. held: the ``AddRequest`` records that arrived meanwhile, in order. aborted,
        retracted: requests ended by ``abort_all_requests`` / ``retract_requests``.
    """

    update: WeightUpdate
    served: ModelConfig
    future: object
    load_timeout_s: float = 600.0
    deadline: float = 0.0
    held: list = field(default_factory=list)
    aborted: int = 0
    retracted: int = 0
