"""RankWorker: one rank of the engine (one GPU, or one process on CPU).

Written as a plain class so the single-rank ``Engine`` runs it in-process and tests can drive it directly;
``ray.remote(RankWorker)`` turns it into the actor that owns a rank in a cluster. It holds the rank's model shard,
KV pools, attention backend and runner, and answers each step of its DP group.
"""

from __future__ import annotations

from raymoe.comm.groups import ParallelGroups
from raymoe.runner.model_runner import ModelRunner, RunnerConfig
from raymoe.scheduler.model_worker_batch import ModelWorkerBatch, StepOutput


class RankWorker:
    """Owns a ``ModelRunner``.

    Args:
        runner_cfg: model path, dtype, KV sizes, backends.
        groups: this rank's process groups (``ParallelGroups.single()`` for one rank).
    """

    def __init__(self, runner_cfg: RunnerConfig, groups: ParallelGroups | None = None):
        self.groups = groups or ParallelGroups.single()
        self.runner = ModelRunner(runner_cfg, self.groups)

    def step(self, batch: ModelWorkerBatch) -> StepOutput:
        """Run one step of this rank's DP group (IDLE batches included) and return its sampled tokens."""
        return self.runner.forward_batch_generation(batch)

    def ready(self) -> bool:
        """True once the shard is loaded (used as a start-up barrier)."""
        return True
