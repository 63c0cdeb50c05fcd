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
a write to it runs.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Sequence

from raymoe.kvcache.kv_layout import KVLayout
from raymoe.kvcache.kv_transfer import KVTransferError, peer_metadata

_POLL_S = 0.0002


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

    def __init__(self, name: str, layout: KVLayout, host: str = "127.0.0.1"):
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        api = _nixl_api()
        self.name, self.layout, self.host = name, layout, host
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._lock = threading.Lock()  # one NIXL call at a time: transfers of several requests share the agent
        self._agent = api.nixl_agent(name, config)
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
        if peer not in self._remote:
            raise KVTransferError(f"KV send {tag!r}: unknown peer {peer!r} (add_peer first)")
        remote, signature = self._remote[peer]
        with self._lock:
            handle = self._agent.make_prepped_xfer(
                "WRITE", self._local, self.layout.page_indices(src_slots), remote,
                self.layout.page_indices(dst_slots, signature["num_slots"]), tag.encode())
        try:
            with self._lock:
                state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise KVTransferError(f"KV send {tag!r} with {peer!r} did not complete within {timeout_s} s")
                time.sleep(_POLL_S)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise KVTransferError(f"KV send {tag!r} to {peer!r} failed in NIXL")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    def receive(self, peer: str, dst_slots: Sequence[int], tag: str, timeout_s: float) -> None:
        want = tag.encode()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                new = self._agent.get_new_notifs()
            for agent, notes in new.items():
                agent = agent.decode() if isinstance(agent, bytes) else agent
                self._notes.setdefault(agent, []).extend(notes)
            seen = self._notes.get(peer, [])
            if want in seen:
                seen.remove(want)
                return
            if time.monotonic() > deadline:
                raise KVTransferError(f"KV receive {tag!r} with {peer!r} did not complete within {timeout_s} s")
            time.sleep(_POLL_S)

    def close(self) -> None:
        for peer in list(self._remote):
            self._agent.remove_remote_agent(peer)
        self._remote.clear()
        self._agent.deregister_memory(self._reg)
