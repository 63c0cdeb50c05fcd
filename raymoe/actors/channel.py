"""The front end <-> driver channel: one authenticated Unix-domain socket between two processes of one node.

Per engine step the driver sends one :data:`~raymoe.actors.driver_service.OutputBatch` and the front end sends
its new requests and aborts as ``(adds, aborts)`` tuples; both are pickled Python objects
(``multiprocessing.connection``, stdlib). A message costs tens of microseconds of CPU here, where a Ray streaming
generator item or actor call cost about 1.5 ms of CPU across both processes (measured on the 2-core CI machine),
which at a few milliseconds per decode step is a large share of the machine. The socket is private and
authenticated (``raymoe.actors.private_socket``). The driver actor is therefore placed on the front end's node
(``raymoe.actors.driver_actor.start_driver_actor``).
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Connection

from raymoe.actors.private_socket import PrivateListener, connect_private


class ChannelListener:
    """The front end's end: listens on a private socket path until the driver connects.

    Attributes:
        path: socket path to hand to the driver. authkey: the shared key (random, 32 bytes).
    """

    def __init__(self):
        self._listener = PrivateListener("raymoe-chan-", "driver.sock")
        self.path, self.authkey = self._listener.path, self._listener.authkey
        self._conn: Connection | None = None
        self._accepted = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="raymoe-channel-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        try:
            self._conn = self._listener.accept()
        except OSError:  # closed before the driver connected
            pass
        self._accepted.set()

    def accept(self, timeout_s: float) -> Connection:
        """The driver's connection, once it has connected.

        Raises:
            TimeoutError: no authenticated connection within ``timeout_s`` seconds.
        """
        if not self._accepted.wait(timeout_s) or self._conn is None:
            raise TimeoutError(f"the driver did not connect to {self.path} within {timeout_s} s")
        return self._conn

    def close(self) -> None:
        """Close the listener and the connection and remove the socket directory."""
        if self._conn is not None:
            self._conn.close()
        self._listener.close()


def connect_channel(path: str, authkey: bytes) -> Connection:
    """The driver's end: connect to a :class:`ChannelListener` on this node.

    Raises:
        OSError: no listener at ``path`` (the driver is not on the front end's node).
        multiprocessing.AuthenticationError: the key does not match.
    """
    return connect_private(path, authkey)
