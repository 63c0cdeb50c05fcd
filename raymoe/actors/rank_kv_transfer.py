"""A rank's end of KV transfers between engines (prefill -> decode): the rank starts its own agent over its pool.

Ownership: mixed into :class:`~raymoe.actors.rank_worker.RankWorker`; the agent (``raymoe.kvcache.kv_transfer``)
lives in the rank's process, next to the pool it reads and writes. The engine's driver actor starts the agents of
its ranks, collects their metadata and hands them the other engine's (``DriverActor.start_kv_transfer`` /
``add_kv_peers``), so nothing but the ranks and the driver actors takes part. Transfers run on the calling thread,
not the step thread: with the step channel the rank keeps computing steps meanwhile (the slots moved are held by
the schedulers of both engines for the transfer's duration, so no step touches them). An agent that writes
one-sided (NIXL) also gets a ``KVStreamer`` on the rank's runner: prefill steps then write streamed requests'
rows layer by layer themselves (``raymoe.kvcache.kv_stream``), on the step thread's forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raymoe.kvcache.kv_layout import KVLayout
from raymoe.kvcache.kv_stream import KVStreamer
from raymoe.kvcache.kv_transfer import KVTransferAgent, KVTransferError, make_kv_transfer


class RankKVTransfer:
    """KV transfer methods of a rank (module docstring). Expects ``self.runner`` (its ``token_to_kv_pool``) and
    ``self.runner_cfg`` (its ``page_size``)."""

    _kv_agent: KVTransferAgent | None = None

    def _kv_layout(self) -> KVLayout:
        if self.runner is None:
            raise KVTransferError("this rank has no model loaded yet")
        return KVLayout.of_pool(self.runner.token_to_kv_pool, self.runner_cfg.page_size)

    def start_kv_transfer(self, name: str, backend: str = "auto", host: str | None = None) -> bytes:
        """Start this rank's agent (again: the old one is closed) and return its metadata.

        Args:
            name: the agent's name (unique among the engines' ranks). backend: ``auto`` | ``nixl`` | ``gloo``.
            host: the address peers reach this rank at (None: this node's Ray address).
        """
        import ray

        layout = self._kv_layout()
        if self.runner.kv_streamer is not None:
            self.runner.kv_streamer.close()
            self.runner.kv_streamer = None
        if self._kv_agent is not None:
            self._kv_agent.close()
        host = host or ray.util.get_node_ip_address()
        self._kv_agent = make_kv_transfer(name, layout, backend, host)
        if self._kv_agent.streams:  # a prefill rank writes streamed requests' rows layer by layer
            self.runner.kv_streamer = KVStreamer(self._kv_agent, layout)
        return self._kv_agent.metadata()

    def add_kv_peers(self, metadata: Sequence[bytes]) -> list[str]:
        """Learn the other engine's ranks; returns their agent names in order.

        Raises:
            KVTransferError: the agent was not started, or a peer runs another backend.
            KVLayoutMismatch: a peer's KV rows differ from this rank's.
        """
        agent = self._agent()
        names = [agent.add_peer(m) for m in metadata]
        agent.connect(names)  # the other engine's ranks are in their add_kv_peers now, too
        return names

    def _agent(self) -> KVTransferAgent:
        if self._kv_agent is None:
            raise KVTransferError("this rank's KV transfer agent was not started (start_kv_transfer)")
        return self._kv_agent

    def send_kv(self, peer: str, src_slots: Sequence[int], dst_slots: Sequence[int], tag: str,
                timeout_s: float) -> None:
        """Write the rows of ``src_slots`` into the peer rank's ``dst_slots`` (``KVTransferAgent.send``)."""
        self._agent().send(peer, list(src_slots), list(dst_slots), tag, timeout_s)

    def expect_kv(self, tag: str, timeout_s: float) -> None:
        """A streamed request's rows will arrive while this rank computes (``KVTransferAgent.expect``)."""
        self._agent().expect(tag, timeout_s)

    def forget_kv(self, tag: str) -> None:
        """The streamed request went away before its transfer (``KVTransferAgent.forget``)."""
        if self._kv_agent is not None:
            self._kv_agent.forget(tag)

    def receive_kv(self, peer: str, dst_slots: Sequence[int], tag: str, timeout_s: float) -> None:
        """Wait for the peer rank's rows in ``dst_slots`` (``KVTransferAgent.receive``)."""
        self._agent().receive(peer, list(dst_slots), tag, timeout_s)

    def read_kv(self, slots: Sequence[int]) -> torch.Tensor:
        """The rows of ``slots`` of every KV buffer as flat uint8 on the CPU (``KVLayout.gather``; checks)."""
        return self._kv_layout().gather(list(slots)).cpu()
