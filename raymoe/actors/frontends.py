"""Several front ends per engine: whose request a row belongs to, and a publisher's connections to the front ends.

One engine (a driver actor, its DP group processes and ranks) may serve several front-end processes: the one that
started it and any number that attached to it by name (``EngineClient.attach``). Each front end has an id (``""``
for the one that started the engine) and prefixes the ids of the requests it submits with it
(:func:`engine_request_id`), so the owner of every output row is read from its request id alone
(:func:`frontend_of`) by whichever process publishes it (the driver, or a group process), with no table to keep in
step. A publisher holds one connection per front end (:class:`OutputFanout`) and sends each only its own rows;
the output path therefore grows with the number of groups and front ends, not through one process.

A front end that goes away (its channel to the driver closes) has its in-flight requests aborted by the driver,
which frees their KV (``DriverActor``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from raymoe.actors.output_batch import OutputBatch

FRONTEND_SEP = "\x1e"
"""Between a front end's id and its caller's request id in an engine request id (ASCII record separator: not in
the ids the HTTP front end makes, and refused in callers' ids by ``EngineClient.generate``)."""


def engine_request_id(frontend: str, request_id: str) -> str:
    """The id the engine knows ``request_id`` of front end ``frontend`` by (unchanged for the starting one, ``""``)."""
    return f"{frontend}{FRONTEND_SEP}{request_id}" if frontend else request_id


def frontend_of(rid: str) -> str:
    """The id of the front end that submitted engine request ``rid`` (``""``: the one that started the engine)."""
    head, sep, _ = rid.partition(FRONTEND_SEP)
    return head if sep else ""


class OutputFanout:
    """A publisher's connections to an engine's front ends, one per front-end id (thread-safe).

    Rows published while no front end is connected are kept and sent to the first one that connects (the engine
    starts before its front end's channel is up). With one front end connected every row goes to it (a front end
    ignores rows of requests it does not serve); with several, each gets the rows of its own requests, and rows of
    a front end that is not connected are dropped (its requests are being aborted).

    Args:
        send: sends one batch over one connection; raises ``OSError`` when the peer is gone.
    """

    def __init__(self, send: Callable[[Connection, OutputBatch], None]):
        self._send = send
        self._lock = threading.Lock()
        self._conns: dict[str, Connection] = {}
        self._early = OutputBatch()

    def connect(self, frontend: str, conn: Connection) -> Connection | None:
        """Send ``frontend``'s rows over ``conn`` from now on (with the rows kept while none was connected);
        returns the connection it replaces, for the caller to close, or None."""
        with self._lock:
            old = self._conns.get(frontend)
            self._conns[frontend] = conn
            if len(self._early):
                early, self._early = self._early, OutputBatch()
                self._send_rows(early)
        return old

    def drop(self, frontend: str, conn: Connection | None = None) -> bool:
        """Forget ``frontend``'s connection (only if it still is ``conn``, when given); returns whether it did."""
        with self._lock:
            current = self._conns.get(frontend)
            if current is None or (conn is not None and current is not conn):
                return False
            del self._conns[frontend]
            return True

    @property
    def frontends(self) -> list[str]:
        """The ids of the connected front ends."""
        with self._lock:
            return list(self._conns)

    def publish(self, batch: OutputBatch) -> None:
        """Send ``batch``'s rows to their front ends (class docstring)."""
        with self._lock:
            if not self._conns:
                self._early.extend(batch)
                return
            self._send_rows(batch)

    def _send_rows(self, batch: OutputBatch) -> None:
        if len(self._conns) == 1:
            parts = {next(iter(self._conns)): batch}
        else:
            parts = batch.split(frontend_of)
        for frontend, part in parts.items():
            conn = self._conns.get(frontend)
            if conn is None:
                continue
            try:
                self._send(conn, part)
            except OSError:  # the front end went away; its reader on the driver aborts its requests
                pass
