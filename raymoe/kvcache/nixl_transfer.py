"""The NIXL agent of a rank (``raymoe.kvcache.kv_transfer``): KV rows written straight into the peer's pool.

NIXL (NVIDIA Inference Xfer Library; the transfer layer of vLLM's NixlConnector, Dynamo and Ray Serve LLM's PD
deployments) moves registered memory between agents through a backend, UCX here: shared memory or TCP between
processes of a node, RDMA or NVLink where present. Each agent registers its pool's buffers once (``DRAM`` on CPU
ranks, ``VRAM`` on GPU ranks) and prepares one descriptor per (buffer, KV page) on its own side and, per peer, on the
peer's side (``prep_xfer_dlist``); a transfer is a ``WRITE`` of chosen descriptor indices (``make_prepped_xfer``,
which merges runs of consecutive pages into one request) carrying a notification with the transfer's tag, which the
receiver polls for.

Metadata goes through the caller (``get_agent_metadata`` / ``add_remote_agent``, ``get_serialized_descs`` /
``deserialize_descs``): the agent's metadata listener stays off, so nothing listens on 0.0.0.0; on 127.0.0.1 UCX is
held to the loopback device (``UCX_NET_DEVICES=lo``, unless set) so it opens no listener on other interfaces.
NIXL's progress thread stays off: it busy-polls (measured: three idle agents kept two cores busy), and the transfers
here are two-sided, so the receiver is inside a NIXL call (``get_new_notifs``, which progresses UCX) for as long as
a write to it runs. Layer-by-layer writes (``raymoe.kvcache.kv_stream``) arrive while the decode rank computes, so
they must complete without it. UCX's error-handling mode decides that: NIXL's default, ``peer`` (keep-alives that
detect a dead peer), excludes the shared-memory transports, so between processes of one node the messages go over
TCP and a write completes only after its target's worker progressed (measured: the rows landed, the write stayed in
progress while the target computed). The agents therefore use mode ``none`` (both ends of a pair must: a pair of
mixed modes never connected, measured): between processes of one node a write is a cross-memory copy by the writer
that completes at once (0.5 us for a 256-byte page), and a dead peer is still reported, as
``NIXL_ERR_REMOTE_DISCONNECT`` on the next write or notification (measured with a SIGKILLed target; the writer
lives on); every wait here has its own bound besides. Some writes still need the target's progress: across nodes
(TCP emulates writes with messages) and, measured under ``raymoe bench pd``, between some rank processes of one
node too (writes to one decode rank stayed in progress for 30 s while writes to the other completed; the cause was
not isolated). So a decode rank that expects a streamed request polls its notifications on a thread of its own
(:meth:`expect`, every :data:`EXPECT_POLL_S`) until the request's notification came, it was :meth:`forget` -ten, or
its bound passed; with it the same benchmark streamed every request.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Sequence

from raymoe.kvcache.kv_layout import KVLayout
from raymoe.kvcache.kv_transfer import KVTransferError, peer_metadata
from raymoe.step.kv_stream import FAILED_SUFFIX

_POLL_S = 0.0002
EXPECT_POLL_S = {"cpu": 0.005, "cuda": 0.001}
"""How often a decode rank expecting a streamed request progresses UCX, by the rank's device (seconds). On CPU ranks
the poller shares the cores with the ranks' compute: polling every 1 ms added 10-18 ms to an unloaded PD request's
TTFT on the 2-core machine (a 1,500-token prompt, a ~25 ms prefill step; the decode ranks' pollers took CPU from
the prefill), every 5 ms about 2 ms, while a streamed write waits at most one interval for its completion. GPU
nodes have cores to spare."""
_HELLO = "raymoe-kv-hello"  # the greeting of connect()


def _nixl_api():
    """NIXL's Python API module, whichever wheel provides it.

    Raises:
        ImportError: no NIXL package is installed (``pip install nixl-cu12``).
    """
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise ImportError("KV transfer backend 'nixl' needs NIXL: pip install nixl-cu12 (or nixl-cu13)")


class NixlKVTransfer:
    """A rank's NIXL agent over its KV pool (module docstring).

    Args:
        name: the agent's name (unique among its peers). layout: the rank's KV buffers. host: the address peers
            reach this rank at (``127.0.0.1`` keeps UCX on loopback).

    Raises:
        ImportError: NIXL is not installed.
    """

    backend = "nixl"
    streams = True  # one-sided writes: a prefill rank can write rows layer by layer (raymoe.kvcache.kv_stream)

    def __init__(self, name: str, layout: KVLayout, host: str = "127.0.0.1"):
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        api = _nixl_api()
        self.name, self.layout, self.host = name, layout, host
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._lock = threading.Lock()  # one NIXL call at a time: transfers of several requests share the agent
        self._agent = api.nixl_agent(name, config)
        # module docstring: shared-memory transports between processes of a node (writes complete without the peer)
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        cuda = layout.device_type == "cuda"
        self._mem = "VRAM" if cuda else "DRAM"
        dev = (layout.buffers[0].device.index or 0) if cuda else 0
        self._reg = self._agent.register_memory(
            [(b.data_ptr(), b.numel() * b.element_size(), dev, "") for b in layout.buffers], self._mem)
        pages = [(addr, size, dev) for addr, size in layout.page_ranges()]
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", pages, self._mem)
        self._pages = self._agent.get_serialized_descs(self._agent.get_xfer_descs(pages, self._mem))
        self._remote: dict[str, tuple[object, dict]] = {}  # peer -> (prepared descriptor list, layout signature)
        self._notes: dict[str, list[bytes]] = {}  # notifications seen, not yet waited for
        self._expected: dict[str, float] = {}  # streamed tags this (decode) rank expects -> poll until (monotonic)
        self._poll_s = EXPECT_POLL_S["cuda" if cuda else "cpu"]
        self._poller: threading.Thread | None = None
        self._closed = False

    def metadata(self) -> bytes:
        return pickle.dumps({"backend": self.backend, "name": self.name, "agent": self._agent.get_agent_metadata(),
                             "pages": self._pages, "layout": self.layout.signature()})

    def add_peer(self, metadata: bytes) -> str:
        meta = peer_metadata(metadata, self.backend, self.layout)
        peer = self._agent.add_remote_agent(meta["agent"])
        peer = peer.decode() if isinstance(peer, bytes) else peer  # notifications name agents as str
        remote = self._agent.prep_xfer_dlist(peer, self._agent.deserialize_descs(meta["pages"]), self._mem)
        self._remote[peer] = (remote, meta["layout"])
        return peer

    def send(self, peer: str, src_slots: Sequence[int], dst_slots: Sequence[int], tag: str,
             timeout_s: float) -> None:
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"send: {len(src_slots)} source slots for {len(dst_slots)} destination slots")
        handle = self._start_write(peer, self.layout.page_indices(src_slots),
                                   lambda num_slots: self.layout.page_indices(dst_slots, num_slots), tag.encode())
        try:
            deadline = time.monotonic() + timeout_s
            while (state := self.write_state(handle)) not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise KVTransferError(f"KV send {tag!r} with {peer!r} did not complete within {timeout_s} s")
                time.sleep(_POLL_S)
            if state == "ERR":
                raise KVTransferError(f"KV send {tag!r} to {peer!r} failed in NIXL")
        finally:
            self.release(handle)

    def _start_write(self, peer: str, local: list[int], remote_of, notif: bytes = b""):
        """Post a ``WRITE`` of our descriptors ``local`` into the peer's ``remote_of(peer's slot count)``, carrying
        ``notif`` (empty: none); returns its handle.

        Raises:
            KVTransferError: an unknown peer, or NIXL refused the write at once.
        """
        if peer not in self._remote:
            raise KVTransferError(f"KV write: unknown peer {peer!r} (add_peer first)")
        remote, signature = self._remote[peer]
        with self._lock:
            handle = self._agent.make_prepped_xfer("WRITE", self._local, local, remote,
                                                   remote_of(signature["num_slots"]), notif)
            try:
                state = self._agent.transfer(handle)
            except BaseException:
                self._agent.release_xfer_handle(handle)
                raise
        if state == "ERR":
            self.release(handle)
            raise KVTransferError(f"KV write to {peer!r} failed in NIXL")
        return handle

    def connect(self, peers: Sequence[str], timeout_s: float = 60.0) -> None:
        """Greet every peer and wait for each one's greeting, so that UCX's endpoint wire-up, which needs both ends
        progressing, is done before the first layer-by-layer write (whose target is computing, not in NIXL). The
        peers call this at the same time (``add_kv_peers`` on both engines); it also proves each pair can talk
        before a request depends on it.

        Raises:
            KVTransferError: a peer did not greet within ``timeout_s``.
        """
        for peer in peers:
            self.notify(peer, _HELLO)
        waiting, deadline = set(peers), time.monotonic() + timeout_s
        while waiting:
            self._collect_notes()
            for peer in list(waiting):
                seen = self._notes.get(peer, [])
                if _HELLO.encode() in seen:
                    seen.remove(_HELLO.encode())
                    waiting.discard(peer)
            if waiting and time.monotonic() > deadline:
                raise KVTransferError(f"KV agents {sorted(waiting)} did not answer {self.name!r} within {timeout_s} s")
            if waiting:
                time.sleep(_POLL_S)

    def expect(self, tag: str, timeout_s: float) -> None:
        """Keep UCX progressing (module docstring) until :meth:`receive` of ``tag`` returns, :meth:`forget`
        drops it, or ``timeout_s`` seconds pass."""
        with self._lock:
            self._expected[tag] = time.monotonic() + timeout_s
            if self._poller is None or not self._poller.is_alive():
                self._poller = threading.Thread(target=self._poll_expected, name=f"raymoe-kv-poll-{self.name}",
                                                daemon=True)
                self._poller.start()

    def forget(self, tag: str) -> None:
        """Stop expecting ``tag`` (its request went away before its transfer)."""
        with self._lock:
            self._expected.pop(tag, None)

    def _poll_expected(self) -> None:
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                for tag in [t for t, until in self._expected.items() if until < now]:
                    del self._expected[tag]
                if not self._expected:
                    self._poller = None
                    return
            self._collect_notes()
            time.sleep(self._poll_s)

    def _collect_notes(self) -> None:
        with self._lock:
            new = self._agent.get_new_notifs()
        for agent, notes in new.items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            self._notes.setdefault(agent, []).extend(notes)

    # ---------------------------------------------------------------- layer-by-layer writes (kv_stream)
    def post_write(self, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], layers: Sequence[int]):
        """Start a ``WRITE`` of our ``src_pages`` of KV ``layers`` into the peer's ``dst_pages`` (same count,
        pages as ``KVLayout.pages_touched`` gives them) without a notification; returns its handle (poll
        :meth:`write_state`, then :meth:`release`).

        Raises:
            KVTransferError: an unknown peer, or NIXL refused the write.
        """
        return self._start_write(peer, self.layout.layer_indices(src_pages, layers),
                                 lambda num_slots: self.layout.layer_indices(dst_pages, layers, num_slots))

    def write_state(self, handle) -> str:
        """``"DONE"`` (the rows have landed), ``"PROC"`` or ``"ERR"`` for a :meth:`post_write` handle."""
        with self._lock:
            return self._agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        with self._lock:
            self._agent.release_xfer_handle(handle)

    def notify(self, peer: str, message: str) -> None:
        """Send ``message`` to the peer's :meth:`receive` (which waits for it by tag)."""
        with self._lock:
            self._agent.send_notif(peer, message.encode())

    def receive(self, peer: str, dst_slots: Sequence[int], tag: str, timeout_s: float) -> None:
        """Wait for the notification ``tag`` from ``peer`` (a :meth:`send`, or a streamed request's last step).

        Raises:
            KVTransferError: none came within ``timeout_s``, or the peer reported that it could not write the rows.
        """
        try:
            self._receive(peer, tag, timeout_s)
        finally:
            self.forget(tag)

    def _receive(self, peer: str, tag: str, timeout_s: float) -> None:
        want, failed = tag.encode(), (tag + FAILED_SUFFIX).encode()
        deadline = time.monotonic() + timeout_s
        while True:
            self._collect_notes()
            seen = self._notes.get(peer, [])
            if want in seen:
                seen.remove(want)
                return
            if failed in seen:
                seen.remove(failed)
                raise KVTransferError(f"KV receive {tag!r}: {peer!r} could not write the rows")
            if time.monotonic() > deadline:
                raise KVTransferError(f"KV receive {tag!r} with {peer!r} did not complete within {timeout_s} s")
            time.sleep(_POLL_S)

    def close(self) -> None:
        self._closed = True
        poller = self._poller
        if poller is not None:
            poller.join(timeout=1.0)
        for peer in list(self._remote):
            self._agent.remove_remote_agent(peer)
        self._remote.clear()
        self._agent.deregister_memory(self._reg)
