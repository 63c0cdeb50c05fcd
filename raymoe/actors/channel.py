"""The front end <-> engine channel: authenticated sockets between the front end and the driver, and, when each DP
group's scheduler runs in a process of its own, from every group to the front end.

The driver's connection carries both ways: the front end sends its new requests and aborts as ``(adds, aborts)``
tuples and the driver sends one :data:`~raymoe.actors.output_batch.OutputBatch` per loop iteration. A group's
connection carries that group's output rows only (``raymoe.actors.group_actor.OutputPublisher``), so the output
path grows with the number of groups instead of passing through the driver. All messages are pickled Python objects
(``multiprocessing.connection``, stdlib). A message costs tens of microseconds of CPU here, where a Ray streaming
generator item or actor call cost about 1.5 ms of CPU across both processes (measured on the 2-core CI machine),
which at a few milliseconds per decode step is a large share of the machine.

Every connection starts with a hello naming its peer (``("driver",)`` or ``("group", index)``). The socket is a
private Unix socket (``raymoe.actors.private_socket``) when every peer is on the front end's node (the driver actor
is placed there: ``raymoe.actors.driver_actor.start_driver_actor``), else TCP on the node's address.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing import AuthenticationError, Pipe
from multiprocessing.connection import Connection

from raymoe.actors.private_socket import Address, PrivateListener, connect_private

log = logging.getLogger(__name__)

DRIVER_HELLO = ("driver",)


class ChannelListener:
    """The front end's end: accepts the driver's connection and the groups' output connections until closed.

    Args:
        host: listen on TCP on this address (groups on other nodes) instead of a Unix socket (None).

    Attributes:
        address (also ``path``): what to hand to the driver. authkey: the shared key (random, 32 bytes).
        group_conns: DP group -> its output connection (a reconnecting group replaces its previous one).
        wake: a connection that becomes readable when a group connection was added (for ``multiprocessing.
            connection.wait`` in the reader; read it with ``recv_bytes``).
    """

    def __init__(self, host: str | None = None):
        self._listener = PrivateListener("raymoe-chan-", "driver.sock", host=host)
        self.address: Address = self._listener.address
        self.path, self.authkey = self.address, self._listener.authkey
        self._conn: Connection | None = None
        self._accepted = threading.Event()
        self._closed = False
        self.group_conns: dict[int, Connection] = {}
        self.wake, self._wake_w = Pipe(duplex=False)
        self._thread = threading.Thread(target=self._accept_loop, name="raymoe-channel-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
                hello = conn.recv()
            except AuthenticationError:
                log.warning("a connection to the engine channel failed the key check; ignored")
                continue
            except (OSError, EOFError):
                if self._closed:
                    self._accepted.set()
                    return
                continue
            if hello == DRIVER_HELLO and self._conn is None:
                self._conn = conn
                self._accepted.set()
            elif isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "group" and isinstance(hello[1], int):
                old, self.group_conns[hello[1]] = self.group_conns.get(hello[1]), conn
                if old is not None:
                    old.close()
                self._wake_w.send_bytes(b"g")
            else:
                conn.close()

    def accept(self, timeout_s: float) -> Connection:
        """The driver's connection, once it has connected.

        Raises:
            TimeoutError: no authenticated connection within ``timeout_s`` seconds.
        """
        if not self._accepted.wait(timeout_s) or self._conn is None:
            raise TimeoutError(f"the driver did not connect to {self.address} within {timeout_s} s")
        return self._conn

    def drop_group(self, conn: Connection) -> None:
        """Forget a group connection that closed (its group process went away; the driver ends its requests)."""
        for index, c in list(self.group_conns.items()):
            if c is conn:
                del self.group_conns[index]
        conn.close()

    def close(self) -> None:
        """Close the listener and every connection (and remove the socket directory)."""
        self._closed = True
        if self._conn is not None:
            self._conn.close()
        for conn in list(self.group_conns.values()):
            conn.close()
        self._listener.close()


def connect_channel(address: Address, authkey: bytes) -> Connection:
    """The driver's end: connect to a :class:`ChannelListener` and say it is the driver.

    Raises:
        OSError: no listener at ``address`` (a Unix socket on another node).
        multiprocessing.AuthenticationError: the key does not match.
    """
    conn = connect_private(address, authkey)
    conn.send(DRIVER_HELLO)
    return conn
