"""Rank programs of the collective-trace tests (module-level: they are pickled into ``dist_harness`` ranks).

Each rank builds ``ModelRunner``s on traced groups (``raymoe.comm.trace.traced_groups``) under one recording whose
``StoreCheck`` compares every collective with the other ranks before it runs (through the world's rendezvous
store), and feeds every runner the same multi-step scenario: per step one batch spec per DP group, planned by the
driver's own functions (TBO decision, graph bucket, dispatch capacity and mode, global token counts) and run
through ``forward_batch_generation`` (eager, or a CPU decode-graph replay). Per runner it returns the trace of its
construction (graph capture included) and, per step, the plan and the trace, for the test to compare across
ranks again (``check_step_traces``: also the carrier of each exchange and the pairing of variable splits).

Batch specs: ``("extend", {row: new tokens})``, ``("decode", [rows])``, ``("mixed", {row: new tokens})`` (extend
rows first, then decode rows as extends of one token, as the scheduler builds them) and :data:`IDLE`.
"""

from __future__ import annotations

from dataclasses import replace

from raymoe.comm.a2a_plan import apply_dispatch_plan
from raymoe.overlap.decision import apply_tbo_decision
from raymoe.runner.graph_buckets import apply_graph_plan
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

IDLE = ("idle",)
_MODES = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE, "mixed": ForwardMode.MIXED}


class GroupSim:
    """The requests of one DP group: per row its token ids and KV slots (deterministic token ids)."""

    def __init__(self, salt: int):
        self.salt = salt
        self.tokens: dict[int, list[int]] = {}
        self.slots: dict[int, list[int]] = {}
        self.next_slot = 1

    def batch(self, spec) -> ModelWorkerBatch:
        """The group's batch of ``spec`` (an IDLE batch for :data:`IDLE`); every row resends its whole prefix."""
        if spec == IDLE:
            return ModelWorkerBatch.idle()
        mode = _MODES[spec[0]]
        news = dict.fromkeys(spec[1], 1) if mode == ForwardMode.DECODE else dict(spec[1])
        ids, locs, prefix_slots, prefix_lens = [], [], [], []
        for row, n in news.items():
            have = self.tokens.setdefault(row, [])
            prefix_lens.append(len(have))
            if mode.is_extend():
                prefix_slots += self.slots.get(row, [])
            new_ids = [(31 * row + 7 * (len(have) + i) + 101 * self.salt) % 1900 + 20 for i in range(n)]
            new_slots = list(range(self.next_slot, self.next_slot + n))
            self.next_slot += n
            ids += new_ids
            locs += new_slots
            have += new_ids
            self.slots.setdefault(row, []).extend(new_slots)
        ext = list(news.values())
        return ModelWorkerBatch(mode, ids, list(news), [p + e for p, e in zip(prefix_lens, ext, strict=True)],
                                prefix_lens, ext, locs, prefix_slots, SamplingInputs.greedy(len(news)))


def plan_step(batches: list[ModelWorkerBatch], cfg) -> list[ModelWorkerBatch]:
    """The driver's step-wide decisions over every group's batch (``Driver._launch_next``), for ranks built with
    ``cfg`` (a ``RunnerConfig``)."""
    tokens = tuple(b.num_tokens for b in batches)
    batches = [replace(b, global_num_tokens=tokens) for b in batches]
    batches = apply_tbo_decision(batches, cfg.overlap)
    batches = apply_graph_plan(batches, cfg.graph_capture_sizes)
    return apply_dispatch_plan(batches, cfg.moe_comm.a2a_mode, cfg.max_dispatch_tokens_per_rank)


def plan_summary(batches: list[ModelWorkerBatch]) -> dict:
    """What the test asserts coverage on: each group's mode and the shared decisions."""
    b = batches[0]
    return {"modes": tuple(x.forward_mode.name for x in batches), "use_tbo": b.use_tbo, "graph_bs": b.graph_bs,
            "capacity": b.dispatch_capacity}


def _runner(groups, path: str, spec: dict):
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(path, "float32", num_kv_slots=512, max_req_rows=8, max_context_len=128, **spec),
                       groups)


def traced_scenario(groups, path: str, runner_specs: dict[str, dict], steps: list[tuple],
                    timeout_s: float = 60.0) -> dict:
    """Run ``steps`` on a runner per entry of ``runner_specs`` (``RunnerConfig`` fields), recording and checking
    every collective. Returns, per runner, ``{"build": trace, "steps": [{"plan": ..., "trace": ...}, ...]}``.

    Raises:
        CollectiveMismatch: the ranks disagree (raised before the collective runs, on every rank involved).
    """
    from raymoe.comm.trace import CollectiveRecorder, recording, traced_groups
    from raymoe.comm.trace_check import StoreCheck, default_store

    groups = traced_groups(groups)
    recorder = CollectiveRecorder(groups, StoreCheck(default_store(), timeout_s=timeout_s))
    out = {}
    with recording(recorder):
        for name, spec in runner_specs.items():
            runner = _runner(groups, path, spec)
            result = {"build": recorder.finish_step(), "steps": []}
            sims = [GroupSim(g) for g in range(len(steps[0]))]
            for step in steps:
                batches = plan_step([sims[g].batch(s) for g, s in enumerate(step)], runner.cfg)
                runner.forward_batch_generation(batches[groups.dp_rank])
                result["steps"].append({"plan": plan_summary(batches), "trace": recorder.finish_step()})
            out[name] = result
    return out


def disagreeing_ranks(groups, path: str, spec: dict, steps: list[tuple]) -> dict:
    """The checker's own test: a skipped ``torch.distributed`` collective on rank 1, then rank 1 forced to the EXTEND
    two-batch-overlap schedule for every batch (rank 0 keeps its DECODE schedule). Returns, per part, what the
    ``CollectiveMismatch`` each rank raised says (None: nothing raised)."""
    import torch
    import torch.distributed as dist

    from raymoe.comm.trace import CollectiveMismatch, CollectiveRecorder, recording, traced_groups
    from raymoe.comm.trace_check import StoreCheck, default_store
    from raymoe.overlap import strategy

    def caught(fn) -> dict | None:
        try:
            fn()
        except CollectiveMismatch as e:
            return {"step": e.step, "group": e.group, "index": e.index, "rank": e.rank, "other": e.other,
                    "mine": e.mine, "theirs": e.theirs, "message": str(e)}
        return None

    groups = traced_groups(groups)
    out = {}

    def skip_one() -> None:
        x = torch.ones(3)
        if groups.world_rank == 0:
            dist.all_reduce(x)
        dist.barrier()
        recorder.finish_step()

    recorder = CollectiveRecorder(groups, StoreCheck(default_store(), prefix="skip"))
    with recording(recorder):
        out["skip"] = caught(skip_one)

    if groups.world_rank == 1:
        strategy.tbo_schedule_mode = lambda mode: ForwardMode.EXTEND
    recorder = CollectiveRecorder(groups, StoreCheck(default_store(), prefix="schedule"))
    with recording(recorder):
        runner = _runner(groups, path, spec)
        recorder.finish_step()
        sims = [GroupSim(g) for g in range(len(steps[0]))]
        out["plans"] = []

        def run_steps() -> None:
            for step in steps:
                batches = plan_step([sims[g].batch(s) for g, s in enumerate(step)], runner.cfg)
                out["plans"].append(plan_summary(batches))
                runner.forward_batch_generation(batches[groups.dp_rank])
                recorder.finish_step()

        out["schedule"] = caught(run_steps)
    return out


def replayed_driver_steps(groups, config, steps: list[list[ModelWorkerBatch]], timeout_s: float = 60.0) -> list:
    """Replay batches the real ``Driver`` sent (``steps``: per step one batch per DP group) on a runner built as the
    engine builds it from ``config`` (an ``EngineConfig`` whose ``model`` is the checkpoint), recording and checking
    every collective. Returns the construction's trace, then each step's.

    Raises:
        CollectiveMismatch: the ranks disagree (before the collective runs).
    """
    from raymoe.actors.factory import runner_config_for
    from raymoe.comm.trace import CollectiveRecorder, recording, traced_groups
    from raymoe.comm.trace_check import StoreCheck, default_store
    from raymoe.config.device_defaults import with_device
    from raymoe.runner.model_runner import ModelRunner

    groups = traced_groups(groups)
    recorder = CollectiveRecorder(groups, StoreCheck(default_store(), timeout_s=timeout_s))
    with recording(recorder):
        runner = ModelRunner(runner_config_for(with_device(config, "cpu", serving=False)), groups)
        traces = [recorder.finish_step()]
        for batches in steps:
            runner.forward_batch_generation(batches[groups.dp_rank])  # placeholders resolve from its own tokens
            traces.append(recorder.finish_step())
    return traces
