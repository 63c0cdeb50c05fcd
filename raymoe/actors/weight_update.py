"""Weight updates: the served model switches to another checkpoint folder of the same architecture, or to tensors a
trainer hands over, without a restart, as a reinforcement-learning loop needs between rollouts (SGLang's
``update_weights_from_disk``, which verl and slime drive over HTTP, and ``update_weights_from_tensor``; on Ray the
tensors travel as one ``ObjectRef``: ``raymoe.client.weight_sync``).

What one update does, on the driver's loop thread, with no request and no step in flight
(``DriverService`` pauses for it: new requests are held; running ones finish, are aborted, or are retracted: ended
with a ``"retracted"`` error that the front end answers by submitting them again with the tokens they delivered,
held like new ones, so their streams pause and go on with the new weights, SGLang's "retract" pause):

1. refuse a folder of another architecture (``raymoe.config.model_compat.check_same_architecture``, naming the
   field) or a world shrunk after a fault: nothing changes;
2. flush every DP group's radix cache (see 4); drop the moves of an expert rebalance not sent yet
   (``EplbController.abort``, as a driver reset does): the committed placement is what every rank holds and what the
   load reads;
3. every rank loads the source into its tensors in place, all at once (``RankWorker.update_weights``; tensors are
   checked by name and shape as they load); when one fails half-way the world loads the previous source again, and
   when that fails too the engine is unhealthy and its ranks are rebuilt (from the previous source);
4. the executor keeps the new source for rebuilds after a fault (tensors: the reference, loaded over the folder).
   Every DP group's radix cache was flushed before the load (its KV was computed with the old weights; nothing is
   cached between the flush and the load, as this thread owns the driver), so a group that cannot flush (KV held
   for the other engine of a PD pair) refuses the update before any weight changes.

A driver actor that Ray restarts starts from its ``EngineConfig`` again, so with the configured folder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from raymoe.config.model import ModelConfig
from raymoe.config.model_compat import check_same_architecture
from raymoe.errors import CheckpointError, EngineUnhealthyError

DEFAULT_WEIGHT_VERSION = "default"
"""The weight version an engine reports before its first update (SGLang's default)."""


@dataclass(frozen=True)
class WeightUpdate:
    """A request to serve other weights: a checkpoint folder (SGLang's ``UpdateWeightFromDiskReqInput`` fields) or
    a trainer's tensors (``update_weights_from_tensor``).

    Attributes:
        model_path: a Hugging Face model folder of the served architecture (same ``config.json`` sizes); None with
            ``tensors``.
        tensors: Hugging Face names -> tensors, every tensor of the served checkpoint (a ``state_dict`` of its
            ``transformers`` class), or a Ray ``ObjectRef`` to such a mapping (each rank fetches it; the engine keeps
            the reference, so ranks rebuilt after a fault load the same weights).
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
        ValueError: neither or both of ``model_path`` and ``tensors``, an empty path or version, a timeout that is
            not positive, or both ``abort_all_requests`` and ``retract_requests``.
    """

    model_path: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    timeout_s: float = 300.0
    retract_requests: bool = False
    tensors: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.model_path is None) == (self.tensors is None):
            raise ValueError("a weight update takes either model_path or tensors")
        if self.model_path is not None and (not isinstance(self.model_path, str) or not self.model_path):
            raise ValueError("model_path must be a non-empty folder path")
        if self.weight_version is not None and (not isinstance(self.weight_version, str) or not self.weight_version):
            raise ValueError("weight_version must be a non-empty string or None")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.abort_all_requests and self.retract_requests:
            raise ValueError("abort_all_requests and retract_requests: the requests in flight are either aborted or "
                             "retracted")

    @property
    def source(self) -> str:
        """The new weights in words (messages)."""
        return self.model_path if self.model_path is not None else "the tensors given"


@dataclass(frozen=True)
class WeightUpdateResult:
    """How an update ended.

    Attributes:
        success: the new weights serve. message: what happened (on failure: why, naming the field or tensor).
        weight_version: the version serving after the call. seconds: the ranks' load time, seconds (0 when none
        loaded). num_aborted_requests: requests ended by ``abort_all_requests``. num_retracted_requests: requests
        retracted (``retract_requests``). param: on failure, the request field at fault (``"model_path"`` /
        ``"tensors"``: another architecture, or weights that would not load; ``"timeout_s"``: requests still in
        flight at the deadline), None when the engine's state refused it (another update in progress, a shrunk
        world, a fault).
    """

    success: bool
    message: str
    weight_version: str
    seconds: float = 0.0
    num_aborted_requests: int = 0
    param: str | None = None
    num_retracted_requests: int = 0


def rank_executor(executor):
    """The executor that holds the ranks: ``executor`` itself, or a ``HostedDriver``'s ``GroupHosts.ranks``."""
    return getattr(executor, "ranks", executor)


def call_ranks(executor, method: str, *args, timeout_s: float) -> list:
    """Call ``RankWorker.<method>(*args)`` on every rank of ``executor`` at once and wait for all: rank actors
    (``RayExecutor``, also under a ``HostedDriver``'s ``GroupHosts``), or the one rank of a ``LocalExecutor`` on
    its rank thread. Raises what a rank raised (a Ray task error wraps it), or ray's ``GetTimeoutError``."""
    ranks = rank_executor(executor)
    workers = list(getattr(ranks, "workers", None) or [])
    if not workers:
        return [ranks.call_rank(method, *args)]
    import ray

    return ray.get([getattr(w, method).remote(*args) for w in workers], timeout=timeout_s)


def _served_source(executor) -> tuple[str, Any]:
    """(folder, tensors or None) the ranks serve now, as their rebuilds would load them."""
    cfg = rank_executor(executor).runner_cfg
    return cfg.model_path, cfg.weight_tensors


def _keep_source(executor, model_path: str, tensors: Any) -> None:
    """Rebuilds of the ranks after a fault (restart, elastic grow) load this source from now on."""
    ranks = rank_executor(executor)
    ranks.runner_cfg = replace(ranks.runner_cfg, model_path=model_path, weight_tensors=tensors)
    if getattr(ranks, "initial_cfg", None) is not None:
        ranks.initial_cfg = replace(ranks.initial_cfg, model_path=model_path, weight_tensors=tensors)


def _cause(e: BaseException) -> str:
    """A rank's error as the caller should read it (Ray wraps it in a task error whose ``cause`` is the original)."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {cause}"


def apply_weight_update(driver, served: ModelConfig, update: WeightUpdate, version: str,
                        load_timeout_s: float = 600.0) -> WeightUpdateResult:
    """Switch ``driver``'s ranks to ``update``'s weights (module docstring); the driver must be idle.

    Args:
        driver: a ``Driver`` or ``HostedDriver`` with no request or step in flight.
        served: the served architecture. version: the weight version serving now.
        load_timeout_s: bound on the ranks' load (and on loading the previous source again), seconds.
    Returns:
        the result; a refusal or a failed load rolled back changes nothing.
    Raises:
        RuntimeError: the driver is not idle. EngineUnhealthyError: the load failed and loading the previous
            source failed too (the caller rebuilds the ranks).
    """
    if driver.has_unfinished():
        raise RuntimeError("apply_weight_update needs an idle driver")
    param = "model_path" if update.model_path is not None else "tensors"
    executor = driver.executor
    previous = _served_source(executor)
    folder = update.model_path if update.model_path is not None else previous[0]
    if update.model_path is not None:
        try:
            check_same_architecture(served, update.model_path)
        except CheckpointError as e:
            return WeightUpdateResult(False, str(e), version, param=param)
        except (OSError, ValueError) as e:  # a path the OS refuses (a NUL byte, too long)
            return WeightUpdateResult(False, f"{update.model_path!r}: {type(e).__name__}: {e}", version, param=param)
    if getattr(rank_executor(executor), "vacant", None):
        return WeightUpdateResult(False, "the rank group runs shrunk after a fault; update the weights once it has "
                                         "grown back (/health)", version)
    try:  # first: nothing is inserted meanwhile (this thread owns the driver), and a refusal changes no weight
        driver.flush_cache()
    except RuntimeError as e:  # KV held for the other engine of a PD pair
        return WeightUpdateResult(False, f"the radix cache cannot be flushed now ({e}); retry", version)
    if driver.eplb is not None and driver.eplb.moving:
        driver.eplb.abort()
    t0 = time.perf_counter()
    try:
        call_ranks(executor, "update_weights", folder, update.tensors, timeout_s=load_timeout_s)
    except Exception as e:  # noqa: BLE001 - any rank's failure: load the previous source on every rank
        why = _cause(e)
        try:
            call_ranks(executor, "update_weights", *previous, timeout_s=load_timeout_s)
        except Exception as again:  # noqa: BLE001 - the ranks hold a mix: they are rebuilt
            raise EngineUnhealthyError(f"loading {update.source} failed ({why}) and loading the previous weights "
                                       f"again failed too ({_cause(again)})") from again
        return WeightUpdateResult(False, f"loading {update.source} failed ({why}); the ranks serve the previous "
                                         "weights again", version, time.perf_counter() - t0, param=param)
    seconds = time.perf_counter() - t0
    _keep_source(executor, folder, update.tensors)
    new_version = update.weight_version or version
    return WeightUpdateResult(True, f"serving {update.source} (version {new_version!r}); radix cache flushed",
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
