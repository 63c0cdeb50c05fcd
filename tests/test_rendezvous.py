"""The world group's rendezvous: rank 0's store listens on the rendezvous address only, never on every interface
(torch's own ``tcp://`` rendezvous binds ``*:port``); the groups built over it still work."""

from __future__ import annotations

import ipaddress
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from raymoe.cluster.rendezvous import rendezvous_store
from raymoe.comm.groups import ParallelGroups
from raymoe.config import ParallelConfig
from tests.dist_harness import run_ranks


def _listening_and_sum(groups: ParallelGroups) -> tuple[list[tuple[str, int]], float]:
    t = torch.full((1,), float(groups.world_rank + 1))
    dist.all_reduce(t, group=groups.ep_group)
    listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    return listening, t.item()


def test_rank_zero_listens_on_loopback_only_and_collectives_work():
    results = run_ranks(_listening_and_sum, ParallelConfig(tp_size=1, dp_size=2, ep_size=2))
    assert [s for _, s in results] == [3.0, 3.0]
    rank0 = results[0][0]
    assert rank0, "rank 0 serves the store: it must listen somewhere"
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in rank0), rank0


def test_only_tcp_urls_are_accepted():
    for bad in ("env://", "file:///tmp/x", "tcp://127.0.0.1", "tcp://:1234"):
        with pytest.raises(ValueError, match="tcp://host:port"):
            rendezvous_store(bad, 0, 1, timedelta(seconds=1))
