"""Step executors: fan one global step out to the ranks and gather each DP group's sampled tokens.

``LocalExecutor`` runs a single in-process rank. ``RayExecutor`` owns the rank actors of a multi-rank world: it
places them (``raymoe.cluster.placement``), runs the process-group rendezvous, and every step sends each rank
its DP group's batch: over the step channel (``fanout="channel"``: a Unix socket per rank on the driver's machine,
``raymoe.actors.step_channel``), through a Ray Compiled Graph (``"compiled"``) or as plain ``.remote()`` calls. A rank
that dies or raises fails the step within seconds (``ray.wait`` on all ranks, first error wins) instead of
leaving the driver blocked behind ranks stuck in a collective; ``restart()`` rebuilds the whole rank group, and
``recover()`` first tries to shrink onto the survivors (``raymoe.actors.elastic_world``).

Two kinds of step failure (``raymoe.actors.step_errors``) are told apart here so that the driver restarts ranks
only for rank faults: :class:`RankFailure` (restart the rank group) and :class:`RankStepError` (fail the step's
requests, keep the ranks when :meth:`RayExecutor.ranks_alive` shows none is stuck).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from raymoe.actors.elastic_world import ElasticWorld
from raymoe.actors.rank_startup import RankGroupTimeouts, rank_actor, start_rank_group
from raymoe.actors.rank_worker import RankWorker
from raymoe.actors.startup_progress import Progress, root_cause
from raymoe.actors.step_channel import StepChannelHub
from raymoe.actors.step_errors import RankFailure, RankStepError, is_collective_error
from raymoe.config import FANOUTS, ParallelConfig
from raymoe.errors import EngineUnhealthyError
from raymoe.runner.runner_config import RunnerConfig
from raymoe.runner.step_result import PendingStep
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch

__all__ = ["FANOUTS", "LocalExecutor", "RankFailure", "RankStepError", "RayExecutor"]

log = logging.getLogger(__name__)


class LocalExecutor:
    """Runs the single rank in this process (no collectives: an exception in a step never wedges it).

    Every call into the rank (building it, each step, a restart) runs on one dedicated rank thread, in order.
    torch's CPU intra-op thread pools belong to the OS thread that uses them: a second thread running torch work
    in the same process brings up a second pool, and on a small machine both then run about 1.7x slower (a
    decode step at 64 rows went from 6.4 to 11 ms, measured). The rank thread starts with the creating thread's
    ``torch.get_num_threads()``. :meth:`launch` queues a step without waiting (overlap scheduling: the driver
    forms the next step meanwhile, torch releasing the GIL inside its kernels); :meth:`execute` waits for it.
    The rank thread only launches each step (``RankWorker.launch_step``); :meth:`collect` waits for its tokens on
    the caller's thread, so on a GPU the rank thread prepares the next step while the device runs this one.
    """

    def __init__(self, runner_cfg: RunnerConfig):
        import torch

        self.runner_cfg = runner_cfg
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raymoe-rank",
                                          initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        self.worker: RankWorker | None = self._thread.submit(RankWorker, runner_cfg).result()

    def execute(self, batches: list[ModelWorkerBatch]) -> list[StepOutput]:
        """Run the step on the rank thread and wait for it.

        Raises:
            RankFailure: the engine is shut down. RankStepError: the rank raised (it stays usable).
        """
        return self.collect(self.launch(batches))

    def _step(self, batches: list[ModelWorkerBatch]) -> PendingStep:
        if self.worker is None:
            raise RankFailure("engine is shut down")
        return self.worker.launch_step(batches[0])

    def launch(self, batches: list[ModelWorkerBatch]) -> Future:
        """Queue the step on the rank thread (steps run in launch order); :meth:`collect` waits for it.

        Raises:
            RankFailure: the engine is shut down.
        """
        if self.worker is None:
            raise RankFailure("engine is shut down")
        return self._thread.submit(self._step, batches)

    def collect(self, handle: Future) -> list[StepOutput]:
        """The outputs of a launched step.

        Raises:
            RankFailure: the engine is shut down. RankStepError: the rank raised (it stays usable).
        """
        try:
            return [handle.result().result()]
        except RankFailure:
            raise
        except Exception as e:
            raise RankStepError(f"the rank raised {type(e).__name__} in a step") from e

    def call_rank(self, method: str, *args):
        """``RankWorker.<method>(*args)`` on the rank thread, waited for (a control call between steps, e.g.
        ``update_weights``).

        Raises:
            RankFailure: the engine is shut down; whatever the rank raised.
        """
        if self.worker is None:
            raise RankFailure("engine is shut down")
        return self._thread.submit(getattr(self.worker, method), *args).result()

    def ranks_alive(self) -> bool:
        """Whether the rank exists (an in-process rank cannot hang in a collective)."""
        return self.worker is not None

    def restart(self) -> None:
        """Build a fresh rank (on the rank thread, after the steps queued before)."""
        self.worker = self._thread.submit(RankWorker, self.runner_cfg).result()

    def shutdown(self) -> None:
        """Drop the rank; steps still queued raise ``RankFailure``. The rank thread ends."""
        self.worker = None
        self._thread.shutdown(wait=False)


class RayExecutor(ElasticWorld):
    """Rank actors of one engine on a Ray cluster.

    Args:
        runner_cfg: per-rank runner settings (``device="cuda"`` uses GPUs where visible).
        parallel: world layout. use_gpu: bundle GPUs (None: when the cluster declares enough).
        fanout: ``"channel"`` (the step channel; falls back to remote when a rank is on another machine),
            ``"remote"`` (plain actor calls), ``"compiled"`` (Ray Compiled Graph, falls back to remote) or
            ``"groups"`` (none of its own: each DP group's process sends its ranks their steps,
            ``raymoe.actors.group_hosts``).
        init_timeout_s: bound on the rendezvous and the step channels, seconds. placement_timeout_s: bound on
            placing the ranks (None: ``init_timeout_s``). load_timeout_s: bound on loading the weights and
            capturing the decode graphs (None: ``init_timeout_s``; the factory passes
            ``raymoe.actors.startup_budget``'s). step_timeout_s: bound on one step, seconds.
        collective_timeout_s: torch.distributed timeout of every collective, seconds.
        progress: called with one line per start-up stage (``raymoe.actors.startup_progress``; None: silent).
        elastic: after a rank fault, :meth:`recover` shrinks onto the survivors where they can serve alone
            (``FaultConfig.elastic_ep``). rejoin_after_s: seconds from a shrink to placing the replacements.
    Raises:
        PlacementError: a GPU world whose cluster does not admit node-ordered ranks (``raymoe.cluster.rank_plan``).
        TimeoutError / EngineUnhealthyError: the ranks could not be placed or started.
    """

    def __init__(self, runner_cfg: RunnerConfig, parallel: ParallelConfig, use_gpu: bool | None = None,
                 fanout: str = "remote", init_timeout_s: float = 180.0, step_timeout_s: float = 300.0,
                 collective_timeout_s: float = 60.0, placement_timeout_s: float | None = None,
                 load_timeout_s: float | None = None, progress: Progress | None = None, elastic: bool = False,
                 rejoin_after_s: float = 5.0):
        if fanout not in (*FANOUTS, "groups"):
            raise ValueError(f"fanout must be one of {(*FANOUTS, 'groups')}, got {fanout!r}")
        self.runner_cfg = runner_cfg
        self.parallel = parallel
        self.use_gpu = use_gpu
        self.fanout = fanout
        self.init_timeout_s = init_timeout_s
        self.step_timeout_s = step_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.placement_timeout_s = placement_timeout_s or init_timeout_s
        self.load_timeout_s = load_timeout_s or init_timeout_s
        self.progress = progress
        self.elastic, self.rejoin_after_s = elastic, rejoin_after_s
        self.initial_parallel, self.initial_cfg = parallel, runner_cfg
        self._init_elastic()
        self.workers: list = []
        self.placements: list = []
        self._dag = None
        self._hub: StepChannelHub | None = None
        self._owner: str | None = None
        self._start()

    def _start(self) -> None:
        from raymoe.cluster.placement import pg_owner_tag, place_ranks

        t0 = time.perf_counter()
        self._owner = self._owner or pg_owner_tag()
        self.placements = place_ranks(self.parallel, self.use_gpu, timeout_s=self.placement_timeout_s,
                                      owner=self._owner, a2a_backend=self.runner_cfg.moe_comm.a2a_backend)
        if self.progress is not None:
            self.progress(f"{len(self.placements)} ranks placed ({'one GPU' if self.use_gpu else 'CPU only'} each) "
                          f"in {time.perf_counter() - t0:.1f} s")
        self.workers = [rank_actor(p, self.runner_cfg, self.parallel, p.rank) for p in self.placements]
        self._start_group(self.workers, self.workers)
        log.info("started %d ranks (%s) in %.1f s", len(self.workers), self.parallel, time.perf_counter() - t0)

    def _start_group(self, workers: list, new: list) -> None:
        """Run the start-up of ``workers`` (rank order; ``new``: those never started, whose CUDA devices are bound
        first) and open the step fan-out.

        Raises:
            EngineUnhealthyError: a stage failed (every rank is shut down).
        """
        import ray

        from raymoe.actors.rank_devices import bind_cuda_devices

        try:
            if new and self.placements[0].num_gpus:  # each rank's CUDA device: its node's GPUs visible, its own
                nodes = ray.get([w.node_id.remote() for w in new], timeout=self.init_timeout_s)
                bind_cuda_devices(new, nodes, self.init_timeout_s)
            start_rank_group(workers, RankGroupTimeouts(self.init_timeout_s, self.load_timeout_s,
                                                        self.collective_timeout_s), self.progress)
        except Exception as e:
            self.shutdown()
            raise EngineUnhealthyError(f"rank group failed to start: {root_cause(e)}") from e
        if self.fanout == "compiled":
            self._dag = self._compile()
        elif self.fanout == "channel":
            self._hub = self._open_channel()

    def _close_fanout(self) -> None:
        """Close the step channel or tear the compiled graph down (the ranks' step threads then end)."""
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:  # noqa: BLE001
                pass
            self._dag = None

    def _compile(self):
        """Build a Compiled Graph: input = list of per-DP-group batches; output = every rank's StepOutput."""
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                outs = [w.step.bind(inp[r // self.parallel.tp_size]) for r, w in enumerate(self.workers)]
                dag = MultiOutputNode(outs)
            return dag.experimental_compile()
        except Exception as e:  # noqa: BLE001 - compiled graphs are optional; plain calls always work
            log.warning("Ray Compiled Graph unavailable (%s); using plain actor calls", e)
            self.fanout = "remote"
            return None

    def _open_channel(self) -> StepChannelHub | None:
        """Connect every rank to a step channel; None (plain calls) when a rank cannot reach its socket."""
        import ray

        hub = StepChannelHub(self.parallel.world_size, self.parallel.tp_size)
        try:
            reached = ray.get([w.start_step_channel.remote(hub.path, hub.authkey) for w in self.workers],
                              timeout=self.init_timeout_s)
            if not all(reached):
                hub.close()
                log.info("a rank cannot reach the driver's step channel (another machine): using actor calls")
                self.fanout = "remote"
                return None
            hub.accept(self.init_timeout_s)
        except Exception as e:
            hub.close()
            self.shutdown()
            raise EngineUnhealthyError(f"rank group failed to open its step channel: {type(e).__name__}: {e}") from e
        return hub

    def execute(self, batches: list[ModelWorkerBatch]) -> list[StepOutput]:
        """Run one step on every rank; returns the tp-rank-0 output of each DP group.

        Raises:
            RankFailure: a rank died, a collective failed, or the step exceeded ``step_timeout_s``.
            RankStepError: a rank raised an ordinary exception (it is alive; see :meth:`ranks_alive`).
        """
        return self.collect(self.launch(batches))

    def launch(self, batches: list[ModelWorkerBatch]):
        """Send the step to every rank without waiting (each rank runs its steps in the order they were sent);
        returns a handle for :meth:`collect`.

        Raises:
            RankFailure: the rank group is not running, or the step could not be sent.
        """
        if not self.workers:
            raise RankFailure("rank group is not running")
        if self.fanout == "groups":
            raise RankFailure("this rank group's steps are sent by its DP groups' processes")
        self.steps_shrunk += bool(self.vacant)
        if self._hub is not None:
            return self._hub.send(batches)  # raises RankFailure
        tp = self.parallel.tp_size
        try:
            if self._dag is not None:
                return self._dag.execute(*batches)
            return [w.step.remote(batches[r // tp]) for r, w in enumerate(self.workers)]
        except Exception as e:
            raise RankFailure(f"sending a step to the ranks failed ({type(e).__name__})") from e

    def collect(self, handle) -> list[StepOutput]:
        """Wait for a launched step (launched steps are collected in launch order).

        Raises:
            RankFailure: a rank died, a collective failed, or the step exceeded ``step_timeout_s``.
            RankStepError: a rank raised an ordinary exception (it is alive; see :meth:`ranks_alive`).
        """
        import ray

        if self._hub is not None:
            return self._hub.gather(handle, self.step_timeout_s)
        tp = self.parallel.tp_size
        try:
            if self._dag is not None:
                outs = ray.get(handle, timeout=self.step_timeout_s)
            else:
                outs = self._gather(handle)
        except EngineUnhealthyError:
            raise
        except ray.exceptions.RayTaskError as e:  # the rank's own code raised; the actor is alive
            cause = getattr(e, "cause", None)
            name = type(cause).__name__ if cause is not None else type(e).__name__
            if isinstance(e, ray.exceptions.RayActorError) or is_collective_error(name):
                raise RankFailure(f"a rank's collectives failed during a step ({name})") from e
            raise RankStepError(f"a rank raised {name} in a step") from e
        except Exception as e:
            raise RankFailure(f"a rank failed during a step ({type(e).__name__})") from e
        return [outs[d * tp] for d in range(self.parallel.dp_size)]

    def _gather(self, refs: list) -> list[StepOutput]:
        import ray

        deadline = time.monotonic() + self.step_timeout_s
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailure(f"step exceeded {self.step_timeout_s} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
            for r in ready:
                ray.get(r)  # raises RayActorError / RayTaskError at once
        return ray.get(refs)

    def ranks_alive(self, timeout_s: float = 5.0) -> bool:
        """Whether every rank answers a liveness probe within ``timeout_s`` seconds (a rank still stuck in a
        collective of a failed step does not: its actor runs one call at a time). With the step channel: whether
        every rank answered the last step (``StepChannelHub.healthy``)."""
        import ray

        if not self.workers:
            return False
        if self._hub is not None:
            return self._hub.healthy
        try:
            return all(ray.get([w.ready.remote() for w in self.workers], timeout=timeout_s))
        except Exception:  # noqa: BLE001
            return False

    def restart(self) -> None:
        """Kill every rank and start a fresh rank group at the initial layout (KV contents are lost)."""
        self.shutdown()
        self._start()

    def shutdown(self) -> None:
        import ray

        from raymoe.cluster.placement import release

        self._close_fanout()
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.workers = []
        release(self.placements + list(self.vacant.values()))
        self.placements = []
        self._drop_elastic_state()
