"""An authenticated socket between two processes (``multiprocessing.connection``, stdlib): a Unix-domain socket
between processes of one node, or TCP when the peer may be on another node.

A Unix socket lives in a fresh directory only its owner can enter (``tempfile.mkdtemp``: mode 0700). Either way
both ends prove they know a random 32-byte key (HMAC challenge) before any message is unpickled. Used by the front
end <-> driver channel (``raymoe.actors.channel``), the driver <-> ranks step channel
(``raymoe.actors.step_channel``) and the driver <-> group scheduler links (``raymoe.actors.group_hosts``), which add
their own accept loops and message formats.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener

Address = str | tuple[str, int]
"""Where a listener is: a Unix socket path, or ``(host, port)`` for TCP."""


class PrivateListener:
    """The listening end: a socket ``path`` in a private directory (or a TCP port on ``host``), and the key a peer
    must prove.

    Args:
        prefix: name prefix of the private directory (under the system's temporary folder).
        name: the socket file's name in it.
        host: listen on TCP on this address (a free port) instead of a Unix socket (None).

    Attributes:
        address: what to hand to the peer (:data:`Address`). path: the same (kept for Unix-socket callers).
        authkey: the shared key (random, 32 bytes).

    Raises:
        OSError: the directory or socket cannot be created.
    """

    def __init__(self, prefix: str, name: str, host: str | None = None):
        self.authkey = os.urandom(32)
        self._dir = None
        if host is None:
            self._dir = tempfile.mkdtemp(prefix=prefix)
            self._listener = Listener(os.path.join(self._dir, name), family="AF_UNIX", authkey=self.authkey)
        else:
            self._listener = Listener((host, 0), family="AF_INET", authkey=self.authkey)
        self.address: Address = self._listener.address
        self.path = self.address

    def accept(self) -> Connection:
        """Block until a peer connects and passes the key check.

        Raises:
            OSError: the listener was closed. multiprocessing.AuthenticationError: the peer's key does not match.
        """
        return self._listener.accept()

    def close(self) -> None:
        """Stop listening and remove the socket directory (connections already accepted stay open)."""
        self._listener.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def connect_private(address: Address, authkey: bytes) -> Connection:
    """The connecting end: connect to a :class:`PrivateListener` and prove the key.

    Raises:
        OSError: no listener at ``address`` (a Unix socket on another node, or closed).
        multiprocessing.AuthenticationError: the key does not match.
    """
    family = "AF_UNIX" if isinstance(address, str) else "AF_INET"
    return Client(address if isinstance(address, str) else tuple(address), family=family, authkey=authkey)


def accept_indexed(listener: PrivateListener, indices: set[int], timeout_s: float) -> dict[int, Connection]:
    """Accept one connection per index in ``indices``, each peer sending its index (an int) first.

    Raises:
        TimeoutError: not every index connected within ``timeout_s`` seconds (the connections made are closed).
    """
    conns: dict[int, Connection] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while set(conns) != indices:
                conn = listener.accept()
                conns[int(conn.recv())] = conn
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=run, name="raymoe-accept", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or errors or set(conns) != indices:
        listener.close()
        for conn in list(conns.values()):
            conn.close()
        why = f"{type(errors[0]).__name__}: {errors[0]}" if errors else f"{len(conns)} of {len(indices)} connected"
        raise TimeoutError(f"peers did not all connect within {timeout_s} s ({why})")
    return conns
