"""RankWorker: one rank of the engine (one GPU, or one process on CPU).

Written as a plain class so the single-rank ``Engine`` runs it in-process and tests can drive it directly;
``ray.remote(RankWorker)`` turns it into the actor that owns a rank in a cluster. It holds the rank's model shard,
KV pools, attention backend and runner, and answers each step of its DP group.

Start-up of a multi-rank world (driven by ``raymoe.actors.executor.RayExecutor``): every actor is created, rank 0
publishes a rendezvous address (:meth:`get_rendezvous_address`), all ranks call :meth:`init_distributed`
concurrently (gloo on CPU, nccl on GPU, with a timeout), then :meth:`load` builds each shard.

Elastic expert parallelism (``raymoe.actors.elastic_plan``): after a fault the surviving ranks stay in their
processes. :meth:`abort_collectives` ends a step stuck waiting for a dead peer, :meth:`reform` leaves the old world
(the step thread ends, the runner and its KV are dropped, the process groups destroyed) and takes the new layout and
rank; the same start-up then runs again (a fresh rendezvous, the shard of the new placement, the decode graphs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from raymoe.actors.rank_kv_transfer import RankKVTransfer
from raymoe.comm.groups import ParallelGroups
from raymoe.config import ParallelConfig
from raymoe.platform.interface import Platform
from raymoe.runner.model_runner import ModelRunner
from raymoe.runner.runner_config import RunnerConfig
from raymoe.runner.step_result import PendingStep
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch


class RankWorker(RankKVTransfer):
    """Owns a ``ModelRunner``.

    Args:
        runner_cfg: model path, dtype, KV sizes, backends; ``device`` is the engine's, decided before any rank
            started (a CUDA rank takes the GPU Ray assigned its actor: ``raymoe.runner.device.rank_device``).
        parallel: the world layout; ``rank``: this rank's index in it.
    """

    def __init__(self, runner_cfg: RunnerConfig, parallel: ParallelConfig | None = None, rank: int = 0):
        self.runner_cfg = runner_cfg
        self.parallel = parallel or ParallelConfig()
        self.rank = rank
        self.groups = ParallelGroups.single()
        self.runner: ModelRunner | None = None
        self._platform: Platform | None = None
        self._injected_step_errors = 0
        self._inject_from_step = 0  # the injected errors start at this step number (steps_launched counts from 1)
        self.steps_launched = 0  # steps this rank launched (every rank launches the same steps, IDLE included)
        self._step_delay = (0.0, 0)  # (seconds, steps left): inject_step_delay
        self._step_thread = None  # the step channel's serving thread (start_step_channel)
        if self.parallel.world_size == 1:
            self.load()

    def get_rendezvous_address(self) -> str:
        """``tcp://ip:port`` of a port on this rank's node (called on rank 0), bound and listening from now on: the
        rank's store takes that socket over in :meth:`init_distributed`, so no other job can take the port in
        between (and have this world's ranks join its store)."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        family, kind, proto, _, addr = socket.getaddrinfo(ip, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.bind(addr)
        sock.listen(max(128, self.parallel.world_size))
        self._rendezvous_sock = sock
        return f"tcp://{ip}:{sock.getsockname()[1]}"

    def init_distributed(self, init_method: str, timeout_s: float = 60.0) -> int:
        """Join the world group and create the TP/EP groups (the EP transport is the rank's platform's); returns
        this process id. Also tunes the process (``raymoe.actors.process_tuning``, the platform's thread count and
        step-thread priority): this runs only in rank actors of multi-rank worlds."""
        from raymoe.actors.process_tuning import set_engine_process_nice
        from raymoe.cluster.topology import init_parallel_groups

        device = self._device()
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.platform.set_rank_threads(self.runner_cfg.cpu_threads, self.parallel.world_size)
        set_engine_process_nice()  # a rank actor: not at Ray's background worker niceness
        self._configure_step_thread()  # the actor thread steps under plain calls
        self.groups = init_parallel_groups(self.rank, self.parallel, init_method, backend, timeout_s,
                                           device_id=device if device.type == "cuda" else None,
                                           cpu_comm=self.runner_cfg.moe_comm.cpu_comm, platform=self.platform,
                                           listen_sock=getattr(self, "_rendezvous_sock", None))
        self._rendezvous_sock = None
        return os.getpid()

    @property
    def platform(self) -> Platform:
        """This rank's platform, chosen once from its device and dtype (``raymoe.platform.selector``)."""
        if self._platform is None:
            import torch

            from raymoe.platform.selector import select_platform

            self._platform = select_platform(self._device(), getattr(torch, self.runner_cfg.dtype))
        return self._platform

    def _configure_step_thread(self) -> None:
        """The platform's tuning of the calling thread, which runs this rank's steps."""
        self.platform.configure_step_thread(self.runner_cfg.cpu_rank_nice, self.parallel.world_size > 1)

    def _device(self):
        """This rank's ``torch.device`` (made current for CUDA). Raises RankDeviceError: CUDA configured but no
        GPU visible (never a silent CPU fallback, which would hang a mixed NCCL/gloo group)."""
        from raymoe.runner.device import rank_device

        return rank_device(self.runner_cfg.device, self.rank)

    def load(self, freeze_heap: bool = False, capture_graphs: bool = True) -> float:
        """Build the runner (loads this rank's shard; with ``capture_graphs`` also captures its decode graphs) on
        this rank's device; returns the seconds it took.

        ``freeze_heap``: this rank owns its process (a Ray actor), so once it is built its start-up heap is frozen
        (``process_tuning.freeze_startup_heap``: no full-heap GC pause inside a step). A rank built inside another
        process (``LocalExecutor``: the offline ``Engine``, a one-rank driver actor) leaves that process's
        collector to its owner.
        """
        import time
        from dataclasses import replace

        from raymoe.actors.process_tuning import freeze_startup_heap

        t0 = time.perf_counter()
        device = self._device()
        self.runner = ModelRunner(replace(self.runner_cfg, device=str(device)), self.groups, self.platform,
                                  capture_graphs=capture_graphs)
        if freeze_heap:
            freeze_startup_heap()
        return time.perf_counter() - t0

    def capture_graphs(self, freeze_heap: bool = False) -> tuple[int, float]:
        """Capture the decode graphs of a rank loaded with ``capture_graphs=False``; returns ``(graphs captured,
        seconds)``. ``freeze_heap`` as in :meth:`load`.

        Raises:
            RuntimeError: the rank is not loaded.
        """
        import time

        from raymoe.actors.process_tuning import freeze_startup_heap

        if self.runner is None:
            raise RuntimeError("capture_graphs before load")
        t0 = time.perf_counter()
        runner = self.runner
        if runner.cfg.graph_capture_sizes and runner.graph_runner is None:
            runner.graph_runner = runner.build_graph_runner()
        if freeze_heap:
            freeze_startup_heap()
        graphs = len(runner.graph_runner.graphs) if runner.graph_runner is not None else 0
        return graphs, time.perf_counter() - t0

    def update_weights(self, model_path: str, tensors=None) -> float:
        """Replace this rank's weights with a source's, in place (``raymoe.runner.weight_reload``): the folder
        ``model_path``, or ``tensors`` (Hugging Face names -> tensors, or a Ray ``ObjectRef`` to them; every tensor
        of the checkpoint) over it; a rebuild after a fault loads the same from now on. Returns the seconds it took.
        Called on every rank of the world at once while no step is in flight (decode graphs captured again where
        they bind addresses run collectives).

        Raises:
            RuntimeError: the rank is not loaded. CheckpointError: another architecture (nothing written), or a
                tensor missing or misshapen (the weights are then a mix: the caller loads a whole source again).
        """
        from dataclasses import replace

        from raymoe.runner.weight_reload import reload_weights

        if self.runner is None:
            raise RuntimeError("update_weights before load")
        self._device()  # current for CUDA on this thread (a capture runs on it)
        seconds = reload_weights(self.runner, model_path, tensors)
        # A mapping (Ray resolved the executor's reference, or an in-process rank) is not kept here: the executor
        # keeps the source its rebuilds load.
        kept = None if isinstance(tensors, Mapping) else tensors
        self.runner_cfg = replace(self.runner_cfg, model_path=model_path, weight_tensors=kept)
        return seconds

    def launch_step(self, batch: ModelWorkerBatch) -> PendingStep:
        """Launch one step of this rank's DP group (IDLE batches included) without waiting for its tokens
        (``ModelRunner.launch_step``); ``.result()`` of the answer waits for them.

        Raises:
            RuntimeError: an error injected by :meth:`inject_step_errors`; otherwise whatever the runner raises.
        """
        self.steps_launched += 1
        if self._step_delay[1] > 0:
            self._step_delay = (self._step_delay[0], self._step_delay[1] - 1)
            time.sleep(self._step_delay[0])
        if self._injected_step_errors > 0 and self.steps_launched >= self._inject_from_step:
            self._injected_step_errors -= 1
            # a fault inside the step: the step's expert update, applied first thing by every rank, is in place
            self.runner.apply_expert_update(batch.expert_update)
            raise RuntimeError("injected step error (fault-injection test hook)")
        return self.runner.launch_step(batch)

    def step(self, batch: ModelWorkerBatch) -> StepOutput:
        """Run one step of this rank's DP group and return its sampled tokens (:meth:`launch_step`, then its
        result: the answer of an actor call or a compiled-graph execution, which must hold the tokens).

        Raises:
            RuntimeError: as :meth:`launch_step`.
        """
        return self.launch_step(batch).result()

    def start_step_channel(self, path: str, authkey: bytes) -> bool:
        """Connect to the driver's step channel (``raymoe.actors.step_channel``) and serve its steps on a thread of
        this rank until the driver closes it. Returns False when the socket cannot be reached from this machine.

        The thread keeps this thread's intra-op thread count (``torch.set_num_threads``), and from then on it alone
        runs the rank's torch work: torch's CPU thread pools belong to OS threads, and a second thread stepping
        the same rank would start another pool. On a platform whose host copies complete later (CUDA,
        ``Platform.async_host_copy``) a second thread answers the steps (it only waits for each step's token copy
        and sends), so the serving thread launches the next step while the device still runs this one.
        """
        import threading

        import torch

        from raymoe.actors.step_channel import connect_step_channel, serve_steps

        conn = connect_step_channel(path, authkey, self.rank)
        if conn is None:
            return False
        threads = torch.get_num_threads()

        def serve() -> None:
            self._configure_step_thread()
            torch.set_num_threads(threads)
            if self.platform.async_host_copy:
                serve_steps(conn, self.rank, self.parallel.tp_size, self.launch_step, deferred=True)
            else:
                serve_steps(conn, self.rank, self.parallel.tp_size, self.step)

        self._step_thread = threading.Thread(target=serve, name="raymoe-step-channel", daemon=True)
        self._step_thread.start()
        return True

    def abort_collectives(self) -> bool:
        """End every wait of this rank's step on its peers (called on the survivors of a rank fault, from the
        actor's call thread while the step thread may be stuck): the EP transport's shared mapping is aborted
        (``EpTransport.abort``: the CPU platform's waits return and raise), and NCCL communicators are aborted
        (``torch.distributed``'s ``_abort_process_group``: a kernel waiting for a dead peer never ends by
        itself). gloo collectives need nothing: they fail when the dead peer's connection closes. The groups are
        not usable afterwards: :meth:`reform` follows. Returns True."""
        import torch.distributed as dist

        if self.groups.ep_transport is not None:
            self.groups.ep_transport.abort()
        if dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        return True

    def reform(self, runner_cfg: RunnerConfig, parallel: ParallelConfig, rank: int, timeout_s: float = 30.0) -> int:
        """Leave the current world and take ``parallel``'s rank ``rank`` (an elastic shrink or grow,
        ``RayExecutor``): waits for the step thread to end (the driver closed the step channel; a step stuck on a
        dead peer ends after :meth:`abort_collectives`), drops the runner (its weights, KV and graphs), destroys
        the process groups and resets the fault-injection hooks. The executor then runs the start-up again
        (:meth:`get_rendezvous_address`, :meth:`init_distributed`, :meth:`load`, :meth:`capture_graphs`), this
        rank loading the slots of ``runner_cfg.expert_location``. Returns the process id (unchanged: no restart).

        Raises:
            TimeoutError: the step thread did not end within ``timeout_s`` seconds (the caller rebuilds the group).
        """
        import gc

        import torch
        import torch.distributed as dist

        if self._step_thread is not None:
            self._step_thread.join(timeout_s)
            if self._step_thread.is_alive():
                raise TimeoutError(f"rank {self.rank}'s step thread did not end within {timeout_s} s")
            self._step_thread = None
        self.runner = None
        self.groups = ParallelGroups.single()
        gc.collect()
        if torch.cuda.is_initialized():  # the old shard's blocks go back before the new one loads
            torch.cuda.empty_cache()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.runner_cfg, self.parallel, self.rank = runner_cfg, parallel, rank
        self.steps_launched = 0
        self._injected_step_errors, self._inject_from_step, self._step_delay = 0, 0, (0.0, 0)
        return os.getpid()

    def inject_step_errors(self, n: int = 1, from_step: int = 0) -> bool:
        """Fault injection for tests: ``n`` steps raise ``RuntimeError`` before computing anything, from step
        number ``from_step`` on (``steps_launched``; 0: the next). Injected on every rank for the same steps, the
        ranks stay in step (none enters a collective the others skip): while steps run, the caller picks a
        ``from_step`` no rank has reached (the step thread runs beside this call, so "the next step" could differ
        between ranks). Returns False, injecting nothing, when this rank has launched ``from_step`` already."""
        if from_step and self.steps_launched >= from_step:
            return False
        self._inject_from_step = int(from_step)
        self._injected_step_errors = int(n)
        return True

    def step_count(self) -> int:
        """Steps this rank has launched (``inject_step_errors``)."""
        return self.steps_launched

    def inject_step_delay(self, delay_s: float, steps: int) -> None:
        """Fault injection for the chaos harness (``raymoe.bench.chaos_faults``): the next ``steps`` steps of this
        rank start ``delay_s`` seconds late (a slow rank: its peers wait in the step's collectives).

        Raises:
            ValueError: a negative delay or step count.
        """
        if delay_s < 0 or steps < 0:
            raise ValueError("delay_s and steps must be >= 0")
        self._step_delay = (float(delay_s), int(steps))

    def ready(self) -> bool:
        """True once the shard is loaded (start-up barrier and liveness probe)."""
        return self.runner is not None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """Ray node id of this rank (placement checks)."""
        import ray

        return ray.get_runtime_context().get_node_id()
