"""The driver's link to one group server: a pickled command out, a pickled reply back, per exchange.

:class:`ConnectionLink` is the served engine's: an authenticated socket (``multiprocessing.connection``; Unix when
the group's process is on the driver's node, TCP otherwise) to a group actor whose thread runs
:func:`serve_group`. :class:`LoopbackLink` runs the server in the caller's thread, pickling both ways so that what
crosses is exactly what would cross a socket, and counts the server's CPU time and the bytes each way (tests and
``raymoe bench driver-scale``).

A link that breaks or stays silent past its bound is a :class:`~raymoe.actors.step_errors.RankFailure`: the
driver restarts the rank group, group processes included. :func:`gather_replies` reads a step's replies as they
arrive, so a group whose ranks died is a rank fault at once, not after the other groups' ranks have waited out
their collective timeouts for their dead peer.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Protocol

from raymoe.actors.group_messages import GroupCommand, GroupControl, GroupReply, GroupStats
from raymoe.actors.group_server import GroupServer
from raymoe.actors.step_errors import RankFailure

log = logging.getLogger(__name__)


class GroupLink(Protocol):
    """One group's end of the driver's exchanges: ``send`` a pickled command, ``recv`` the reply within
    ``timeout_s`` seconds (raising :class:`RankFailure` when the group is gone or silent)."""

    def send(self, payload: bytes) -> None: ...

    def recv(self, timeout_s: float) -> GroupReply: ...


def encode(msg: GroupCommand | GroupControl) -> bytes:
    """A command as it crosses a link (pickled once; the same bytes can go to every group)."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


class ConnectionLink:
    """:class:`GroupLink` over a socket to group ``index``'s process."""

    def __init__(self, conn: Connection, index: int):
        self.conn, self.index = conn, index
        self.broken: str | None = None  # why the link is unusable (a late reply would answer the wrong command)

    def _fail(self, why: str) -> RankFailure:
        self.broken = self.broken or why
        return RankFailure(f"DP group {self.index}'s scheduler {self.broken}")

    def send(self, payload: bytes) -> None:
        if self.broken:
            raise self._fail(self.broken)
        try:
            self.conn.send_bytes(payload)
        except OSError as e:
            raise self._fail(f"went away ({type(e).__name__})") from e

    def recv(self, timeout_s: float) -> GroupReply:
        if self.broken:
            raise self._fail(self.broken)
        try:
            if not self.conn.poll(timeout_s):
                raise self._fail(f"did not answer within {timeout_s} s")
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise self._fail(f"went away ({type(e).__name__})") from e

    def close(self) -> None:
        self.conn.close()


class LoopbackLink:
    """:class:`GroupLink` that runs ``server`` in the caller's thread at :meth:`recv`.

    Attributes:
        cpu_seconds: the server's thread CPU time so far, unpickling and pickling included, seconds.
        bytes_in, bytes_out: bytes of the commands sent and the replies returned so far.
    """

    def __init__(self, server: GroupServer):
        self.server = server
        self.cpu_seconds = 0.0
        self.bytes_in = self.bytes_out = 0
        self._pending: deque[bytes] = deque()

    def send(self, payload: bytes) -> None:
        self.bytes_in += len(payload)
        self._pending.append(payload)

    def recv(self, timeout_s: float) -> GroupReply:
        t0 = time.thread_time()
        data = pickle.dumps(handle_safely(self.server, pickle.loads(self._pending.popleft())),
                            protocol=pickle.HIGHEST_PROTOCOL)
        self.cpu_seconds += time.thread_time() - t0
        self.bytes_out += len(data)
        return pickle.loads(data)


def gather_replies(links: Sequence[GroupLink], timeout_s: float) -> list[GroupReply]:
    """The replies of one exchange, in group order, read as they arrive where the links are sockets.

    A reply that reports a rank failure raises at once: the groups still computing hold ranks that may wait out a
    collective timeout (60 s and more) for a peer that died, and the driver is about to rebuild every rank and group
    process anyway; their links are marked broken (their late replies would answer the wrong command).

    Raises:
        RankFailure: a group reported a rank failure, went away, or did not answer within ``timeout_s``.
    """
    if not all(isinstance(link, ConnectionLink) for link in links):  # in-process links: each answers in turn
        replies = [link.recv(timeout_s) for link in links]
        if (failure := next((r.rank_failure for r in replies if r.rank_failure), None)) is not None:
            raise RankFailure(failure)
        return replies
    replies: list[GroupReply | None] = [None] * len(links)
    waiting = {link.conn: i for i, link in enumerate(links) if not link.broken}
    if len(waiting) < len(links):  # a broken link raises its own failure
        links[next(i for i, link in enumerate(links) if link.broken)].recv(timeout_s)
    deadline = time.monotonic() + timeout_s
    while waiting:
        ready = wait(list(waiting), max(0.0, deadline - time.monotonic()))
        if not ready:
            links[next(iter(waiting.values()))].recv(0.0)  # raises: did not answer in time
        for conn in ready:
            i = waiting.pop(conn)
            replies[i] = reply = links[i].recv(0.0)
            if reply.rank_failure:
                for j in waiting.values():
                    links[j].broken = "was left computing when another group's ranks failed"
                raise RankFailure(reply.rank_failure)
    return replies


def handle_safely(server: GroupServer, msg: GroupCommand | GroupControl) -> GroupReply:
    """``server.handle(msg)``; an exception of the server's own code becomes a reply with ``internal_error`` set
    (the driver then fails every in-flight request and resets the groups, as for an error in its own loop)."""
    try:
        return server.handle(msg)
    except Exception as e:  # noqa: BLE001 - reported to the driver, which owns the decision
        log.exception("DP group scheduler failed on %s", type(msg).__name__)
        return GroupReply(None, GroupStats(has_work=True), internal_error=f"{type(e).__name__}: {e}"[:500])


def serve_group(conn: Connection, server: GroupServer) -> None:
    """Answer the driver's commands on ``conn`` in order until it closes the link or sends ``"stop"``."""
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            reply = handle_safely(server, msg)
            try:
                conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                return
            if isinstance(msg, GroupControl) and msg.kind == "stop":
                return
    finally:
        conn.close()
