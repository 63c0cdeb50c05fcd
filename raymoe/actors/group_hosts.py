"""GroupHosts: the ranks of a multi-rank engine plus one group scheduler process per DP group, linked to the driver:
the executor of a :class:`~raymoe.actors.hosted_driver.HostedDriver` (``EngineConfig.group_schedulers="actors"``).

Start-up, in order: the ranks (``RayExecutor`` with ``fanout="groups"``: placement, rendezvous, weights; no step
fan-out of its own); one :class:`~raymoe.actors.group_actor.GroupSchedulerActor` per DP group, pinned to the node
of the group's first rank; each group's ranks connect to their group's step channel (a Unix socket on that node:
a group whose ranks span nodes is refused); every group connects to the driver's link listener (a Unix socket when
all groups are on the driver's node, else TCP on the driver's node address); and, once the front end is known
(:meth:`GroupHosts.connect_outputs`), every group connects to each front end's channel.

A restart (after a rank fault, a group process that died, or a link that broke) rebuilds all of it: the group
processes hold the KV bookkeeping of ranks that are gone, so they are replaced with them.
"""

from __future__ import annotations

import logging

from raymoe.actors.executor import RayExecutor
from raymoe.actors.group_link import ConnectionLink
from raymoe.actors.private_socket import Address, PrivateListener, accept_indexed
from raymoe.config import EngineConfig
from raymoe.errors import EngineUnhealthyError

log = logging.getLogger(__name__)


class GroupHosts:
    """Ranks and group processes of one engine (module docstring).

    Args:
        config: the engine configuration. ranks: the engine's ``RayExecutor`` (``fanout="groups"``).

    Attributes:
        links: one :class:`~raymoe.actors.group_link.ConnectionLink` per DP group, in DP order.
        actors: the group actors, in DP order.

    Raises:
        EngineUnhealthyError: the group processes could not be started or linked (the ranks are shut down).
    """

    def __init__(self, config: EngineConfig, ranks: RayExecutor):
        self.config, self.ranks = config, ranks
        self.actors: list = []
        self.links: list[ConnectionLink] = []
        self._outputs: dict[str, tuple[Address, bytes]] = {}  # front end -> its channel
        self._start_groups()

    @property
    def workers(self) -> list:
        """The rank actors (fault injection, pids)."""
        return self.ranks.workers

    def _start_groups(self) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from raymoe.actors.group_actor import GroupSchedulerActor

        parallel, timeout = self.config.parallel, self.ranks.init_timeout_s
        tp, dp = parallel.tp_size, parallel.dp_size
        workers = self.ranks.workers
        listener = None
        try:
            nodes = ray.get([w.node_id.remote() for w in workers], timeout=timeout)
            for d in range(dp):
                if len(set(nodes[d * tp:(d + 1) * tp])) != 1:
                    raise EngineUnhealthyError(f"DP group {d}'s ranks span nodes; group schedulers in their own "
                                               "processes need each group's ranks on one node")
            here = ray.get_runtime_context().get_node_id()
            remote = any(nodes[d * tp] != here for d in range(dp))
            host = ray.util.get_node_ip_address() if remote else None
            listener = PrivateListener("raymoe-groups-", "groups.sock", host=host)
            cls = ray.remote(GroupSchedulerActor)
            self.actors = [cls.options(num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=nodes[d * tp], soft=False)).remote(d, self.config, tp) for d in range(dp)]
            for d, actor in enumerate(self.actors):
                path, key = ray.get(actor.rank_channel.remote(), timeout=timeout)
                group = workers[d * tp:(d + 1) * tp]
                if not all(ray.get([w.start_step_channel.remote(path, key) for w in group], timeout=timeout)):
                    raise EngineUnhealthyError(f"a rank of DP group {d} cannot reach its group's step channel")
                ray.get(actor.accept_ranks.remote(timeout), timeout=timeout + 10)
            connected = [a.connect_driver.remote(listener.address, listener.authkey) for a in self.actors]
            conns = accept_indexed(listener, set(range(dp)), timeout)
            ray.get(connected, timeout=timeout)
            self.links = [ConnectionLink(conns[d], d) for d in range(dp)]
            for frontend, (address, authkey) in list(self._outputs.items()):
                try:
                    self.connect_outputs(address, authkey, frontend)
                except Exception as e:  # noqa: BLE001 - that front end is gone; the others are served
                    log.warning("front end %r cannot be reached after a restart (%s); forgetting it", frontend,
                                type(e).__name__)
                    self._outputs.pop(frontend, None)
        except Exception as e:
            self.shutdown()
            if isinstance(e, EngineUnhealthyError):
                raise
            raise EngineUnhealthyError(f"DP group schedulers failed to start: {type(e).__name__}: {e}") from e
        finally:
            if listener is not None:
                listener.close()
        log.info("started %d DP group scheduler processes", dp)

    def connect_outputs(self, address: Address, authkey: bytes, frontend: str = "") -> None:
        """Have every group send front end ``frontend``'s output rows to its channel at ``address`` (also after
        restarts; ``raymoe.actors.frontends``)."""
        import ray

        self._outputs[frontend] = (address, authkey)
        ray.get([a.connect_outputs.remote(address, authkey, frontend) for a in self.actors], timeout=60)

    def disconnect_outputs(self, frontend: str) -> None:
        """Forget front end ``frontend`` (it went away): no group sends it rows any more."""
        import ray

        if self._outputs.pop(frontend, None) is not None:
            ray.get([a.disconnect_outputs.remote(frontend) for a in self.actors], timeout=60)

    def pids(self) -> list[int]:
        """Process ids of the group actors."""
        import ray

        return ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def ranks_alive(self) -> bool:
        """Whether every rank answers a liveness probe."""
        return self.ranks.ranks_alive()

    def restart(self) -> None:
        """Rebuild the ranks and the group processes (module docstring)."""
        self._stop_groups()
        self.ranks.restart()
        self._start_groups()

    def _stop_groups(self) -> None:
        import ray

        for link in self.links:
            link.close()
        self.links = []
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []

    def shutdown(self) -> None:
        """Stop the group processes and the ranks."""
        self._stop_groups()
        self.ranks.shutdown()
