"""The rank group's side of elastic expert parallelism: shrink onto the survivors of a fault, grow back when
replacement ranks have started (``raymoe.actors.elastic_plan`` decides whether the survivors can serve alone).

:class:`ElasticWorld` is the part of ``RayExecutor`` that changes the world while the processes stay:

* **Shrink** (:meth:`ElasticWorld.recover` after a ``RankFailure``): find the lost ranks (dead actors, or ranks
  that do not answer a probe on their call thread, which the step channel leaves free), plan the survivors' world,
  kill the lost DP groups' other ranks, close the step fan-out, abort the survivors' collectives (a step may wait
  on a dead peer) and have each survivor :meth:`~raymoe.actors.rank_worker.RankWorker.reform` into its new rank;
  then the usual start-up runs among them: a fresh rendezvous, each survivor loading the slots it holds in the
  shrunken placement, decode graphs, the fan-out. The lost ranks' placement bundles stay reserved.
* **Grow** (:meth:`ElasticWorld.grow`): ``rejoin_after_s`` after a shrink, one replacement actor per lost rank is
  created in that rank's bundle (Ray starts it once the bundle is placed again: at once when only the process
  died, when the node is back or another node has room otherwise); once every replacement answers
  (:meth:`ElasticWorld.replacements_ready`), the survivors reform into their original ranks and the world
  starts again at its original layout and placement.

Either way the ranks' KV is rebuilt, so the driver fails its in-flight requests as ``unhealthy`` and the front
end resumes them (``raymoe.client.request_resume``): the client sees a pause. What elastic EP saves is the
capacity to serve at all: with a node gone and no spare one, a rebuild must wait for room, a shrink serves at
once on fewer ranks. Every step of it is bounded; a shrink that fails rebuilds the whole group instead.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from raymoe.actors.elastic_plan import CannotShrink, ShrinkPlan, plan_shrink
from raymoe.actors.rank_startup import rank_actor
from raymoe.config import ParallelConfig
from raymoe.eplb.location import ExpertLocation
from raymoe.runner.runner_config import RunnerConfig

log = logging.getLogger(__name__)


class ElasticWorld:
    """Shrink and grow of a ``RayExecutor``'s world (module docstring).

    The executor sets, before its first start: ``elastic`` (allow shrinks), ``rejoin_after_s`` (seconds),
    ``initial_parallel`` / ``initial_cfg`` (the layout and runner settings a grow returns to) and calls
    :meth:`_init_elastic`. It provides ``workers``, ``placements``, ``parallel``, ``runner_cfg``, ``fanout``,
    ``init_timeout_s``, ``collective_timeout_s``, ``_close_fanout()``, ``_start_group(workers, new)`` and
    ``restart()``.

    Attributes:
        original_ranks: each current rank's rank in the initial layout. vacant: the lost ranks' placements by
            original rank (their bundles stay reserved for the replacements; empty unless shrunk).
        steps_shrunk: steps launched while shrunk (the executor counts them).
    """

    elastic: bool
    rejoin_after_s: float
    initial_parallel: ParallelConfig
    initial_cfg: RunnerConfig

    def _init_elastic(self) -> None:
        self.original_ranks = list(range(self.initial_parallel.world_size))
        self.vacant: dict[int, object] = {}
        self._joining: dict[int, tuple[object, object]] = {}  # original rank -> (replacement actor, its pid ref)
        self._shrunk_at: float | None = None
        self.steps_shrunk = 0

    @property
    def shrunk(self) -> bool:
        """Whether the world is smaller than its initial layout."""
        return bool(self.vacant)

    # ------------------------------------------------------------------------------------------------ shrink
    def lost_ranks(self, probe_s: float = 2.0) -> list[int]:
        """Ranks whose actor died or did not answer a probe within ``probe_s`` seconds (a stopped process; with
        the step channel a rank stuck in a step still answers, its call thread being free)."""
        import ray

        refs = [w.pid.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=probe_s)
        lost = []
        for r, ref in enumerate(refs):
            if ref not in ready:
                lost.append(r)
                continue
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - RayActorError: the actor is dead
                lost.append(r)
        return lost

    def recover(self, location: ExpertLocation | None = None) -> str:
        """After a rank fault: shrink onto the survivors when ``elastic`` and they can serve alone, else rebuild
        the whole group (``restart``). Returns ``"shrink"`` or ``"restart"``.

        Args:
            location: the expert placement the ranks hold now (the EPLB controller's, after rebalances); None: the
                one they were loaded with.
        Raises:
            TimeoutError / EngineUnhealthyError: the rebuild could not start the ranks.
        """
        if self.elastic and self.fanout != "groups" and self.workers:  # none after a failed grow: rebuild
            try:
                plan = plan_shrink(self.parallel, location or self.runner_cfg.expert_location, self.lost_ranks())
                self.shrink(plan)
                return "shrink"
            except CannotShrink as e:
                log.warning("rank fault: rebuilding the rank group (%s)", e)
            except Exception:  # noqa: BLE001 - any failure of the shrink itself: rebuild
                log.exception("shrinking the rank group failed; rebuilding it")
        self.restart()
        return "restart"

    def shrink(self, plan: ShrinkPlan) -> None:
        """Continue on ``plan.survivors`` in ``plan.parallel`` (module docstring).

        Raises:
            Exception: a survivor could not reform or start (the caller rebuilds the group).
        """
        import ray

        t0 = time.perf_counter()
        self._close_fanout()
        keep = set(plan.survivors)
        for r, w in enumerate(self.workers):
            if r not in keep:
                self.vacant[self.original_ranks[r]] = self.placements[r]
                try:
                    ray.kill(w, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
        survivors = [self.workers[r] for r in plan.survivors]
        ray.get([w.abort_collectives.remote() for w in survivors], timeout=self.init_timeout_s)
        cfg = dataclasses.replace(self.runner_cfg, expert_location=plan.location)
        ray.get([w.reform.remote(cfg, plan.parallel, i, self.collective_timeout_s) for i, w in enumerate(survivors)],
                timeout=self.init_timeout_s + self.collective_timeout_s)
        self.original_ranks = [self.original_ranks[r] for r in plan.survivors]
        self.placements = [self.placements[r] for r in plan.survivors]
        self.workers, self.parallel, self.runner_cfg = survivors, plan.parallel, cfg
        self._start_group(survivors, ())
        self._shrunk_at = time.monotonic()
        log.warning("rank group shrank to %s (lost DP groups %s) in %.1f s", plan.parallel, list(plan.lost_groups),
                    time.perf_counter() - t0)

    # -------------------------------------------------------------------------------------------------- grow
    def replacements_ready(self) -> bool:
        """Whether every lost rank's replacement has started (creating them, in their reserved bundles, once
        ``rejoin_after_s`` has passed since the shrink). Cheap: never blocks."""
        import ray

        if not self.vacant or self._shrunk_at is None or time.monotonic() - self._shrunk_at < self.rejoin_after_s:
            return False
        if not self._joining:
            self._place_replacements()
        probes = [probe for _, probe in self._joining.values()]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=0)
        return len(ready) == len(probes)

    def _place_replacements(self) -> None:
        for rank, p in self.vacant.items():
            actor = rank_actor(p, self.initial_cfg, self.initial_parallel, rank)
            self._joining[rank] = (actor, actor.pid.remote())

    def grow(self) -> None:
        """Return to the initial layout with the started replacements (:meth:`replacements_ready`): the survivors
        reform into their original ranks, every rank loads the initial placement's slots.

        Raises:
            RuntimeError: no replacement is ready. Exception: a rank could not reform or start (the caller
                rebuilds the group).
        """
        import ray

        if not self.replacements_ready():
            raise RuntimeError("grow needs every replacement rank started (replacements_ready)")
        t0 = time.perf_counter()
        self._close_fanout()
        ray.get([w.reform.remote(self.initial_cfg, self.initial_parallel, orig, self.collective_timeout_s)
                 for w, orig in zip(self.workers, self.original_ranks, strict=True)],
                timeout=self.init_timeout_s + self.collective_timeout_s)
        by_rank = dict(zip(self.original_ranks, zip(self.workers, self.placements, strict=True), strict=True))
        joined = [actor for actor, _ in self._joining.values()]
        by_rank.update({r: (actor, self.vacant[r]) for r, (actor, _) in self._joining.items()})
        order = sorted(by_rank)
        self.workers = [by_rank[r][0] for r in order]
        self.placements = [by_rank[r][1] for r in order]
        self.original_ranks = order
        self.parallel, self.runner_cfg = self.initial_parallel, self.initial_cfg
        self.vacant, self._joining, self._shrunk_at = {}, {}, None
        self._start_group(self.workers, joined)
        log.warning("rank group grew back to %s in %.1f s", self.parallel, time.perf_counter() - t0)

    def _drop_elastic_state(self) -> None:
        """Forget shrinks (a full rebuild returns to the initial layout): kill starting replacements."""
        import ray

        for actor, _ in self._joining.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.original_ranks = list(range(self.initial_parallel.world_size))
        self.vacant, self._joining, self._shrunk_at = {}, {}, None
        self.parallel, self.runner_cfg = self.initial_parallel, self.initial_cfg


def recover_ranks(driver) -> str:
    """After a rank fault: recover the driver's ranks (an :class:`ElasticWorld` shrinks where it can, any other
    executor restarts) and reset the driver to the ranks' DP groups and its EPLB controller to their placement.
    Returns ``"shrink"`` or ``"restart"``.

    Raises:
        Exception: the ranks could not be started again (the caller stays unhealthy and retries).
    """
    executor, eplb = driver.executor, driver.eplb
    if not isinstance(executor, ElasticWorld):
        restart_ranks(driver)
        return "restart"
    how = executor.recover(eplb.location if eplb is not None else None)
    _reset_to(driver, executor)
    return how


def restart_ranks(driver) -> None:
    """Rebuild the driver's whole rank group at its initial layout and reset the driver and its EPLB controller
    (the offline ``Engine``'s recovery, and :func:`recover_ranks` for executors that cannot shrink).

    Raises:
        Exception: the ranks could not be started again.
    """
    driver.executor.restart()
    driver.reset()
    if driver.eplb is not None:  # the new ranks loaded the initial expert placement
        driver.eplb.ranks_restarted()


def idle_lost_ranks(driver) -> list[int]:
    """The driver's ranks that died or stopped answering (``ElasticWorld.lost_ranks``), probed while no step runs;
    ``[]`` where the executor cannot tell (one rank in this process, group processes) or a compiled graph occupies
    the ranks' call threads (a live rank would look lost)."""
    executor = driver.executor
    if not isinstance(executor, ElasticWorld) or not executor.workers or executor.fanout not in ("channel", "remote"):
        return []
    return executor.lost_ranks()


def can_grow(driver) -> bool:
    """Whether the driver's ranks are shrunk and their replacements have started (never blocks)."""
    executor = driver.executor
    return isinstance(executor, ElasticWorld) and executor.shrunk and executor.replacements_ready()


def grow_ranks(driver) -> None:
    """Grow the driver's shrunk ranks back (:meth:`ElasticWorld.grow`) and reset the driver to them.

    Raises:
        Exception: as :meth:`ElasticWorld.grow` (the driver is reset to nothing usable; rebuild the group).
    """
    driver.executor.grow()
    _reset_to(driver, driver.executor)


def _reset_to(driver, executor: ElasticWorld) -> None:
    driver.reset(dp_size=executor.parallel.dp_size)
    if driver.eplb is not None and executor.runner_cfg.expert_location is not None:
        driver.eplb.ranks_reformed(executor.runner_cfg.expert_location, executor.parallel.ep_size)
