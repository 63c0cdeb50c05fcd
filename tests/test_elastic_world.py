"""The recovery decision of an elastic rank group (``raymoe.actors.elastic_world``), without Ray: a shrink where
the survivors can serve alone, a rebuild otherwise or when the shrink itself fails, and the driver and its EPLB
controller reset to whatever the ranks then run."""

from __future__ import annotations

import dataclasses

import pytest

from raymoe.actors.elastic_plan import ShrinkPlan
from raymoe.actors.elastic_world import ElasticWorld, recover_ranks, restart_ranks
from raymoe.config import ParallelConfig
from raymoe.eplb.location import ExpertLocation


@dataclasses.dataclass(frozen=True)
class _Cfg:
    expert_location: ExpertLocation | None


class _World(ElasticWorld):
    """An ``ElasticWorld`` whose Ray-facing steps are recorded instead of run."""

    def __init__(self, parallel: ParallelConfig, location: ExpertLocation | None, lost: list[int],
                 elastic: bool = True, fanout: str = "channel", shrink_fails: bool = False):
        self.elastic, self.rejoin_after_s, self.fanout = elastic, 5.0, fanout
        self.initial_parallel = self.parallel = parallel
        self.initial_cfg = self.runner_cfg = _Cfg(location)
        self._init_elastic()
        self.workers = list(range(parallel.world_size))
        self._lost, self._shrink_fails = lost, shrink_fails
        self.calls: list[str] = []

    def lost_ranks(self, probe_s: float = 2.0) -> list[int]:
        return list(self._lost)

    def shrink(self, plan: ShrinkPlan) -> None:
        self.calls.append("shrink")
        if self._shrink_fails:
            raise RuntimeError("a survivor could not reform")
        self.parallel = plan.parallel
        self.runner_cfg = _Cfg(plan.location)

    def restart(self) -> None:
        self.calls.append("restart")
        self.parallel, self.runner_cfg = self.initial_parallel, self.initial_cfg


class _Driver:
    def __init__(self, executor, eplb=None):
        self.executor, self.eplb, self.resets = executor, eplb, []

    def reset(self, dp_size=None):
        self.resets.append(dp_size)
        return []


class _Eplb:
    def __init__(self, location):
        self.location, self.calls = location, []

    def ranks_reformed(self, location, ep_size):
        self.calls.append(("reformed", location.num_physical, ep_size))

    def ranks_restarted(self):
        self.calls.append(("restarted",))


DP2 = ParallelConfig(dp_size=2, ep_size=2)
FULL = ExpertLocation.trivial(2, 8, 16)  # each expert on both ranks
TWO_EXTRA = ExpertLocation.trivial(2, 8, 10)  # experts 2..4 on rank 0 only


def test_a_lost_rank_whose_experts_live_on_the_survivor_shrinks_and_resets_the_driver_to_one_group():
    world = _World(DP2, FULL, lost=[1])
    eplb = _Eplb(FULL)
    driver = _Driver(world, eplb)
    assert recover_ranks(driver) == "shrink"
    assert world.calls == ["shrink"] and world.parallel.dp_size == 1
    assert driver.resets == [1]
    assert eplb.calls == [("reformed", 8, 1)]


@pytest.mark.parametrize("case", ["no replica", "elastic off", "group processes", "shrink fails", "all lost"])
def test_otherwise_the_whole_group_is_rebuilt_at_its_initial_layout(case):
    world = _World(DP2, TWO_EXTRA if case == "no replica" else FULL, lost=[0, 1] if case == "all lost" else [0],
                   elastic=case != "elastic off", fanout="groups" if case == "group processes" else "channel",
                   shrink_fails=case == "shrink fails")
    driver = _Driver(world, _Eplb(world.runner_cfg.expert_location))
    assert recover_ranks(driver) == "restart"
    assert world.calls[-1] == "restart" and world.parallel == DP2
    assert driver.resets == [2]
    assert world.calls == (["shrink", "restart"] if case == "shrink fails" else ["restart"])


def test_the_location_the_eplb_controller_holds_decides_not_the_one_loaded():
    world = _World(DP2, FULL, lost=[0])
    driver = _Driver(world, _Eplb(TWO_EXTRA))  # a rebalance left experts 2..4 on rank 0 only
    assert recover_ranks(driver) == "restart"


def test_an_executor_that_cannot_shrink_restarts():
    class Plain:
        def __init__(self):
            self.restarts = 0

        def restart(self):
            self.restarts += 1

    eplb = _Eplb(FULL)
    driver = _Driver(Plain(), eplb)
    assert recover_ranks(driver) == "restart"
    restart_ranks(driver)
    assert driver.executor.restarts == 2 and driver.resets == [None, None]
    assert eplb.calls == [("restarted",), ("restarted",)]
