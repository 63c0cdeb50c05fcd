"""LoopbackGroups: a :class:`~raymoe.actors.hosted_driver.HostedDriver`'s group servers in the caller's process,
behind pickling loopback links (``raymoe.actors.group_link.LoopbackLink``).

Everything a group process does runs here, message bytes included, one group after another: the tests check the
hosted driver's protocol without Ray, and ``raymoe bench driver-scale`` measures each group's CPU per step apart
from the driver's (``LoopbackLink.cpu_seconds``). Each group drives its own one-group step executor (a fake or
instant one: ``launch([batch])`` / ``collect(handle)`` / ``ranks_alive()``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from raymoe.actors.group_link import LoopbackLink
from raymoe.actors.group_scheduler import GroupScheduler
from raymoe.actors.group_server import ExecutorRanks, GroupServer
from raymoe.actors.output_batch import OutputBatch
from raymoe.config import EngineConfig


class LoopbackGroups:
    """The executor of a hosted driver whose groups run in this process.

    Args:
        config: the engine configuration. eos_token_ids, detokenize, vocab_size: as ``GroupScheduler``.
        make_ranks: group index -> that group's one-group step executor (called again on :meth:`restart`).
        publish: receives every group's output rows (``OutputBatch``), as the front end would.
        dp_size: number of groups.

    Attributes:
        links: one :class:`LoopbackLink` per group, in DP order. servers: the group servers. restarts: restarts.
    """

    def __init__(self, config: EngineConfig, eos_token_ids: Sequence[int],
                 detokenize: Callable[[Sequence[int]], str] | None, vocab_size: int | None,
                 make_ranks: Callable[[int], object], publish: Callable[[OutputBatch], None], dp_size: int):
        self._args = (config, tuple(eos_token_ids), detokenize, vocab_size)
        self.make_ranks, self.publish, self.dp_size = make_ranks, publish, dp_size
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self.rank_executors = [self.make_ranks(d) for d in range(self.dp_size)]
        self.servers = []
        for d, ranks in enumerate(self.rank_executors):
            make_group = partial(GroupScheduler, d, *self._args)
            self.servers.append(GroupServer(make_group(), ExecutorRanks(ranks), self.publish, make_group))
        self.links = [LoopbackLink(s) for s in self.servers]

    def ranks_alive(self) -> bool:
        """Whether every group's ranks answer."""
        return all(s.ranks.alive() for s in self.servers)

    def restart(self) -> None:
        """Fresh ranks and fresh group servers (their requests are lost, as when the processes are rebuilt)."""
        self.restarts += 1
        self._start()

    def shutdown(self) -> None:
        """Nothing to release (kept for the executor interface)."""
