"""An authenticated Unix-domain socket between two processes of one node (``multiprocessing.connection``, stdlib).

The socket lives in a fresh directory only its owner can enter (``tempfile.mkdtemp``: mode 0700), and both ends
prove they know a random 32-byte key (HMAC challenge) before any message is unpickled. Used by the front end <->
driver channel (``raymoe.actors.channel``) and the driver <-> ranks step channel (``raymoe.actors.step_channel``),
which add their own accept loops and message formats.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from multiprocessing.connection import Client, Connection, Listener


class PrivateListener:
    """The listening end: a socket ``path`` in a private directory, and the key a peer must prove.

    Args:
        prefix: name prefix of the private directory (under the system's temporary folder).
        name: the socket file's name in it.

    Attributes:
        path: socket path to hand to the peer. authkey: the shared key (random, 32 bytes).

    Raises:
        OSError: the directory or socket cannot be created.
    """

    def __init__(self, prefix: str, name: str):
        self._dir = tempfile.mkdtemp(prefix=prefix)
        self.path = os.path.join(self._dir, name)
        self.authkey = os.urandom(32)
        self._listener = Listener(self.path, family="AF_UNIX", authkey=self.authkey)

    def accept(self) -> Connection:
        """Block until a peer connects and passes the key check.

        Raises:
            OSError: the listener was closed. multiprocessing.AuthenticationError: the peer's key does not match.
        """
        return self._listener.accept()

    def close(self) -> None:
        """Stop listening and remove the socket directory (connections already accepted stay open)."""
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def connect_private(path: str, authkey: bytes) -> Connection:
    """The connecting end: connect to a :class:`PrivateListener` on this node and prove the key.

    Raises:
        OSError: no listener at ``path`` (it is on another node, or closed).
        multiprocessing.AuthenticationError: the key does not match.
    """
    return Client(path, family="AF_UNIX", authkey=authkey)
