"""Moving KV rows between two ranks of different engines (prefill -> decode): the agent each rank starts, and its
torch.distributed fallback.

Ownership: one agent per rank, built over the rank's pool (``raymoe.kvcache.kv_layout.KVLayout``). Peers learn
how to reach each other from :meth:`KVTransferAgent.metadata`, a few hundred bytes the engines' driver actors pass
along over Ray: no agent listens for metadata itself. A transfer is two-sided: the sending rank calls
:meth:`~KVTransferAgent.send` (source slots, the receiver's slots) while the receiving rank calls
:meth:`~KVTransferAgent.receive` (its slots); each returns when the rows have landed, or raises
:class:`KVTransferError` within ``timeout_s`` (never a hang), so the caller can free both sides' slots.

Backends (``make_kv_transfer``): ``nixl`` (``raymoe.kvcache.nixl_transfer``: NIXL over UCX, registered DRAM on CPU
ranks and VRAM on GPU ranks, the receiver's rows written directly, zero-copy; what vLLM, Dynamo and Ray Serve LLM
move KV with) when the package is installed, else ``gloo``: a two-process gloo group per pair of agents (its
store hosted by the agent whose name sorts first, on the agent's host address), the rows gathered into one
contiguous tensor, sent, received and scattered. ``raymoe env`` reports which one is active.
"""

from __future__ import annotations

import datetime
import importlib.util
import pickle
import zlib
from collections.abc import Sequence
from typing import Protocol

import torch

from raymoe.kvcache.kv_layout import KVLayout

KV_TRANSFER_BACKENDS = ("auto", "nixl", "gloo")


class KVTransferError(RuntimeError):
    """A KV transfer failed or did not complete within its bound (the message says which and why)."""


class KVTransferAgent(Protocol):
    """One rank's end of KV transfers (module docstring).

    Attributes:
        backend: ``"nixl"`` or ``"gloo"``. name: unique among the agents that talk to each other.
        streams: whether a prefill rank can write rows layer by layer while it computes
            (``raymoe.kvcache.kv_stream``; ``post_write`` / ``write_state`` / ``release`` / ``notify``).
    """

    backend: str
    name: str
    streams: bool

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (pass it to the peer's :meth:`add_peer`)."""

    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer; returns its name. Raises ``KVLayoutMismatch`` when its rows differ from ours,
        :class:`KVTransferError` when it runs another backend."""

    def connect(self, peers: Sequence[str], timeout_s: float = 60.0) -> None:
        """Finish connecting to ``peers`` (added already; they call this at the same time). Raises
        :class:`KVTransferError` when one does not answer within ``timeout_s``."""

    def expect(self, tag: str, timeout_s: float) -> None:
        """A receiving rank: a peer will write the rows of ``tag`` while this rank does other work (layer by
        layer); keep the transfer library progressing until :meth:`receive` or :meth:`forget` (at most
        ``timeout_s`` seconds)."""

    def forget(self, tag: str) -> None:
        """Stop expecting ``tag``."""

    def send(self, peer: str, src_slots: Sequence[int], dst_slots: Sequence[int], tag: str,
             timeout_s: float) -> None:
        """Write the rows of our ``src_slots`` into the peer's ``dst_slots`` (same length, whole pages); returns
        when they have landed. Raises :class:`KVTransferError` on failure or after ``timeout_s`` seconds."""

    def receive(self, peer: str, dst_slots: Sequence[int], tag: str, timeout_s: float) -> None:
        """Wait until the peer's :meth:`send` with ``tag`` has written our ``dst_slots``. Raises
        :class:`KVTransferError` after ``timeout_s`` seconds."""

    def close(self) -> None:
        """Release the agent's registrations and connections."""


def nixl_available() -> bool:
    """Whether a NIXL Python package is importable (``nixl``, ``nixl_cu12`` or ``nixl_cu13``)."""
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))


def active_kv_backend(backend: str = "auto") -> str:
    """The backend ``make_kv_transfer(backend=...)`` builds: ``auto`` is ``nixl`` when installed, else ``gloo``.

    Raises:
        ValueError: an unknown backend.
    """
    if backend not in KV_TRANSFER_BACKENDS:
        raise ValueError(f"KV transfer backend must be one of {KV_TRANSFER_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "nixl" if nixl_available() else "gloo"
    return backend


def make_kv_transfer(name: str, layout: KVLayout, backend: str = "auto", host: str = "127.0.0.1"
                     ) -> KVTransferAgent:
    """Start this rank's agent over ``layout``.

    Args:
        name: the agent's name (unique among its peers, e.g. ``"prefill-r0"``).
        layout: the rank's KV buffers. backend: one of :data:`KV_TRANSFER_BACKENDS`.
        host: the address peers reach this rank at (``127.0.0.1`` on a local cluster; the node's cluster address
            otherwise). With ``127.0.0.1`` NIXL's UCX is kept on the loopback device (``UCX_NET_DEVICES=lo``).

    Raises:
        ValueError: an unknown backend. ImportError: ``nixl`` asked for and not installed.
    """
    chosen = active_kv_backend(backend)
    if chosen == "nixl":
        from raymoe.kvcache.nixl_transfer import NixlKVTransfer

        return NixlKVTransfer(name, layout, host)
    return GlooKVTransfer(name, layout, host)


def peer_metadata(metadata: bytes, backend: str, layout: KVLayout) -> dict:
    """A peer's metadata, checked against this agent's backend and layout.

    Raises:
        KVTransferError: the peer runs another backend. KVLayoutMismatch: its KV rows differ from ``layout``'s.
    """
    meta = pickle.loads(metadata)
    if meta["backend"] != backend:
        raise KVTransferError(f"peer {meta['name']!r} runs KV transfer backend {meta['backend']!r}, this rank "
                              f"{backend!r}: both engines need the same one")
    layout.check_peer(meta["layout"])
    return meta


def tag_number(tag: str) -> int:
    """A gloo message tag for ``tag`` (a stable 31-bit hash)."""
    return zlib.crc32(tag.encode()) & 0x7FFFFFFF


class GlooKVTransfer:
    """The fallback agent: a two-process gloo group per peer (module docstring).

    Args:
        name: agent name. layout: the rank's KV buffers. host: this agent's store address.
    """

    backend = "gloo"
    streams = False  # two-sided: the rows move after the prefill, in one send (no layer-by-layer writes)

    def __init__(self, name: str, layout: KVLayout, host: str = "127.0.0.1", connect_timeout_s: float = 60.0):
        import torch.distributed as dist

        self.name, self.layout, self.host = name, layout, host
        self._timeout = datetime.timedelta(seconds=connect_timeout_s)
        self._store = dist.TCPStore(host, 0, None, True, timeout=self._timeout, wait_for_workers=False)
        self._peers: dict[str, dict] = {}
        self._groups: dict[str, object] = {}

    def metadata(self) -> bytes:
        return pickle.dumps({"backend": self.backend, "name": self.name, "host": self.host,
                             "port": self._store.port, "layout": self.layout.signature()})

    def add_peer(self, metadata: bytes) -> str:
        meta = peer_metadata(metadata, self.backend, self.layout)
        self._peers[meta["name"]] = meta
        return meta["name"]

    def connect(self, peers: Sequence[str], timeout_s: float = 60.0) -> None:
        """Nothing to do: a pair's group is built by its first transfer, which both sides enter."""

    def expect(self, tag: str, timeout_s: float) -> None:
        """Nothing to do: gloo transfers are two-sided (``streams`` is False)."""

    def forget(self, tag: str) -> None:
        """Nothing to do (:meth:`expect`)."""

    def _group(self, peer: str):
        """The pair's gloo group, created on first use (both sides block until the other joins)."""
        import torch.distributed as dist

        pg = self._groups.get(peer)
        if pg is not None:
            return pg
        meta = self._peers[peer]
        first = min(self.name, peer)
        if first == self.name:
            store, rank = self._store, 0
        else:
            store, rank = dist.TCPStore(meta["host"], meta["port"], None, False, timeout=self._timeout), 1
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        opts._timeout = self._timeout
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"kv:{first}|{max(self.name, peer)}", store), rank, 2, opts)
        self._groups[peer] = pg
        return pg

    def _peer_rank(self, peer: str) -> int:
        return 1 if min(self.name, peer) == self.name else 0

    def send(self, peer: str, src_slots: Sequence[int], dst_slots: Sequence[int], tag: str,
             timeout_s: float) -> None:
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"send: {len(src_slots)} source slots for {len(dst_slots)} destination slots")
        flat = self.layout.gather(src_slots).cpu()
        self._run(peer, "send", tag, timeout_s, lambda pg: pg.send([flat], self._peer_rank(peer), tag_number(tag)))

    def receive(self, peer: str, dst_slots: Sequence[int], tag: str, timeout_s: float) -> None:
        flat = torch.empty(len(dst_slots) * sum(self.layout.row_bytes), dtype=torch.uint8)
        self._run(peer, "receive", tag, timeout_s, lambda pg: pg.recv([flat], self._peer_rank(peer), tag_number(tag)))
        self.layout.scatter(dst_slots, flat)

    def _run(self, peer: str, what: str, tag: str, timeout_s: float, start) -> None:
        """Start one point-to-point operation on the pair's group and wait for it; a failure or timeout drops the
        group (the next transfer with this peer builds a fresh one) and raises ``KVTransferError``."""
        try:
            ok = start(self._group(peer)).wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            self._groups.pop(peer, None)
            if "Timed out" in str(e):
                raise KVTransferError(f"KV {what} {tag!r} with {peer!r} did not complete within {timeout_s} s") from e
            raise KVTransferError(f"KV {what} {tag!r} with {peer!r} failed: {e}") from e
        if ok is False:
            self._groups.pop(peer, None)
            raise KVTransferError(f"KV {what} {tag!r} with {peer!r} did not complete within {timeout_s} s")

    def close(self) -> None:
        self._groups.clear()
        self._peers.clear()
