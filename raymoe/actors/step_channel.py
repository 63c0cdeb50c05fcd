"""The step channel: the driver's per-step fan-out to rank actors on its own node, over Unix-domain sockets.

A step reaches the ranks as one message per rank and comes back as one reply per rank. Through Ray, each of those
is an actor task: submission, scheduling and result transfer cost about 1.5 ms of CPU per rank and step across
the two processes on the 2-core CI machine, a large share of a decode step of a few milliseconds; a Ray Compiled
Graph avoids the task but its readers poll their channels and take the CPU the ranks need (about 35 % of a core per
idle rank actor; ``raymoe bench fanout --dp 2`` fan-out overhead p50: step channel 0.58 ms, actor calls 3.35 ms,
compiled graph 1.76 ms).
Ranks on the driver's node can do without either: the driver listens on a private socket (the same
authenticated socket as the front end's channel, ``raymoe.actors.private_socket``), each rank
actor connects (:func:`connect_step_channel`; a rank that cannot reach the socket, on another machine, makes the
driver use actor calls) and serves steps in order from a thread of its own (:func:`serve_steps`,
:meth:`RankWorker.start_step_channel`; a GPU rank answers from a second thread, so that it launches the next step
before this one's tokens reached the host):

* driver -> every rank: ``(seq, batch)``, the step's number and the rank's own DP group's ``ModelWorkerBatch``
  (pickled once per group: a rank's bytes per step do not grow with the number of groups);
* rank -> driver: ``(seq, "ok", StepOutput)`` from tp-rank 0 of each DP group (``(seq, "ok", None)`` from the
  others) or ``(seq, "error", type name, message)`` when the rank raised.

Steps are numbered so that a step the driver sent and then abandoned (its loop restarted, or it reset its
schedulers) never answers a later one: :meth:`StepChannelHub.gather` skips the replies of older steps.

A waiting rank blocks in ``recv`` (no CPU while idle) and a message costs tens of microseconds. Ray still owns the
ranks (placement, start-up, restarts, kill) and every other call. Faults, as the Ray fan-out reports them:

* a rank process that dies closes its socket: :class:`RankFailure` at once;
* no reply within the step bound: :class:`RankFailure`;
* a rank that raised a collective error (``step_errors.is_collective_error``): :class:`RankFailure`;
* a rank that raised anything else: the other ranks get ``grace_s`` to answer the same step. If all do, the ranks
  are in step and alive (:class:`RankStepError`, :attr:`StepChannelHub.healthy` stays True); if one does not, it
  is stuck in a collective (:class:`RankFailure`).
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from raymoe.actors.private_socket import PrivateListener, connect_private
from raymoe.actors.step_errors import RankFailure, RankStepError, is_collective_error
from raymoe.step.step_output import StepOutput
from raymoe.step.worker_batch import ModelWorkerBatch


class StepChannelHub:
    """The driver's end of the step channel for ``world_size`` ranks.

    Args:
        world_size: ranks that will connect. tp_size: ranks per DP group (rank ``r`` serves group ``r // tp``).
        first_rank: the global rank of the first of them (a DP group's own hub serves ranks ``first_rank`` ..
            ``first_rank + world_size - 1``; their batches and outputs are indexed from 0).
        grace_s: after one rank reported an error, how long the others may take to answer that step, seconds.
    Attributes:
        path, authkey: what each rank needs to connect (:func:`connect_step_channel`).
        healthy: False once the channel lost a rank or its ranks fell out of step (restart the rank group).
    """

    def __init__(self, world_size: int, tp_size: int, grace_s: float = 5.0, first_rank: int = 0):
        self.world_size, self.tp_size, self.grace_s = world_size, tp_size, grace_s
        self.first_rank = first_rank
        self.last_bytes_per_rank = 0  # the largest message of the last step, bytes
        self._listener = PrivateListener("raymoe-steps-", "steps.sock")
        self.path, self.authkey = self._listener.path, self._listener.authkey
        self._conns: list[Connection] = []
        self._seq = 0  # number of the last step sent
        self.healthy = False
        self._accepted: dict[int, Connection] = {}
        self._accept_error: list[BaseException] = []
        self._accept_thread = threading.Thread(target=self._accept_all, name="raymoe-step-channel-accept",
                                               daemon=True)
        self._accept_thread.start()  # a connecting rank waits for the key check, so accept from the start

    def _accept_all(self) -> None:
        try:
            while len(self._accepted) < self.world_size:
                conn = self._listener.accept()
                self._accepted[int(conn.recv()) - self.first_rank] = conn
        except BaseException as e:  # noqa: BLE001 - reported by accept()
            self._accept_error.append(e)

    def accept(self, timeout_s: float) -> None:
        """Wait until every rank has connected and said its rank.

        Raises:
            TimeoutError: not every rank connected within ``timeout_s`` seconds.
        """
        self._accept_thread.join(timeout_s)
        conns = dict(self._accepted)
        if self._accept_thread.is_alive() or self._accept_error or sorted(conns) != list(range(self.world_size)):
            err = self._accept_error
            self.close()
            why = f"{type(err[0]).__name__}: {err[0]}" if err else f"{len(conns)} connected"
            raise TimeoutError(f"the ranks did not all connect to the step channel within {timeout_s} s ({why})")
        self._conns = [conns[r] for r in range(self.world_size)]
        self.healthy = True

    def send(self, batches: list[ModelWorkerBatch]) -> int:
        """Send one step to every rank: each rank gets its own DP group's batch only (pickled once per group), so
        the bytes a rank receives do not grow with the number of groups. Ranks run steps in the order they were
        sent. Returns the step's number, for :meth:`gather`.

        Raises:
            RankFailure: a rank's socket is closed (its process died).
        """
        self._seq += 1
        payloads = [pickle.dumps((self._seq, b), protocol=pickle.HIGHEST_PROTOCOL) for b in batches]
        self.last_bytes_per_rank = max(map(len, payloads))
        try:
            for r, conn in enumerate(self._conns):
                conn.send_bytes(payloads[r // self.tp_size])
        except OSError as e:
            self.healthy = False
            raise RankFailure(f"sending a step to the ranks failed ({type(e).__name__}: a rank died)") from e
        return self._seq

    def gather(self, seq: int, timeout_s: float) -> list[StepOutput]:
        """Every rank's answer to step ``seq`` (replies to older steps are read and dropped); returns each DP
        group's tp-rank-0 output.

        Raises:
            RankFailure: a rank died, did not answer within ``timeout_s`` seconds, raised a collective error, or
                did not answer within ``grace_s`` of another rank's error.
            RankStepError: a rank raised an ordinary exception and every rank answered the step.
        """
        pending = {conn: r for r, conn in enumerate(self._conns)}
        outs: list[StepOutput | None] = [None] * self.world_size
        deadline = time.monotonic() + timeout_s
        error: tuple[int, str, str] | None = None
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.healthy = False
                silent = sorted(self.first_rank + r for r in pending.values())
                if error is not None:
                    raise RankFailure(f"rank {self.first_rank + error[0]} raised {error[1]} in a step and rank(s) "
                                      f"{silent} did not answer within {self.grace_s} s (stuck in a collective)")
                raise RankFailure(f"step exceeded {timeout_s} s (rank(s) {silent} did not answer)")
            for conn in wait(list(pending), left):
                r = pending[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError) as e:
                    self.healthy = False
                    raise RankFailure(f"rank {self.first_rank + r} closed its step channel (its process died)") from e
                if msg[0] < seq:  # an abandoned step's reply
                    continue
                del pending[conn]
                if msg[1] == "ok":
                    outs[r] = msg[2]
                elif error is None:
                    error = (r, msg[2], msg[3])
                    deadline = min(deadline, time.monotonic() + self.grace_s)
        if error is not None:
            r, name, message = error
            r += self.first_rank
            if is_collective_error(name):
                self.healthy = False
                raise RankFailure(f"rank {r}'s collectives failed during a step ({name}: {message})")
            raise RankStepError(f"rank {r} raised {name} in a step: {message}")
        return [outs[d * self.tp_size] for d in range(self.world_size // self.tp_size)]

    def close(self) -> None:
        """Close every connection (the ranks' serving threads end) and remove the socket."""
        self.healthy = False
        for conn in {*self._conns, *self._accepted.values()}:
            conn.close()
        self._conns = []
        self._accepted = {}
        self._listener.close()


def connect_step_channel(path: str, authkey: bytes, rank: int) -> Connection | None:
    """The rank's end: connect to the hub at ``path`` and say which rank this is; None when the socket cannot be
    reached from here (the rank runs on another machine: the driver then uses actor calls).

    Raises:
        multiprocessing.AuthenticationError: the key does not match.
    """
    try:
        conn = connect_private(path, authkey)
    except OSError:
        return None
    conn.send(rank)
    return conn


def serve_steps(conn: Connection, rank: int, tp_size: int, step: Callable[[ModelWorkerBatch], Any],
                deferred: bool = False) -> None:
    """Answer every step that arrives on ``conn`` with ``step(batch of this rank's DP group)`` until the driver
    closes the channel. An exception in ``step`` is answered as an error and the loop goes on (the driver decides
    whether the ranks are still usable).

    Args:
        step: returns the ``StepOutput``, or with ``deferred`` a launched step whose ``result()`` returns it.
        deferred: answer from a second thread, in order: this thread launches step N+1 while the replier waits
            for step N's tokens (``raymoe.runner.step_result``; a GPU rank's token copy lands while its host
            prepares the next step). The replier only waits and sends; every launch stays on this thread.
    """
    reply_output = rank % tp_size == 0
    replies: queue.SimpleQueue | None = None
    replier: threading.Thread | None = None
    if deferred:
        replies = queue.SimpleQueue()
        replier = threading.Thread(target=_send_replies, args=(conn, replies, reply_output),
                                   name="raymoe-step-replies", daemon=True)
        replier.start()
    try:
        while True:
            try:
                seq, batch = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            try:
                out = step(batch)
                reply = (seq, "ok", out if reply_output or deferred else None)
            except Exception as e:  # noqa: BLE001 - reported to the driver, which owns the decision
                reply = (seq, "error", type(e).__name__, str(e)[:2000])
            if replies is not None:
                replies.put(reply)
                continue
            try:
                conn.send(reply)
            except OSError:
                return
    finally:
        if replies is not None:
            replies.put(None)
            replier.join()
        conn.close()


def _send_replies(conn: Connection, replies: queue.SimpleQueue, reply_output: bool) -> None:
    """The replier of :func:`serve_steps` with ``deferred``: resolve each launched step in launch order (a
    ``result()`` that raises is answered as the step's error) and send it; ends at ``None`` or a closed socket."""
    while True:
        reply = replies.get()
        if reply is None:
            return
        if reply[1] == "ok":
            seq, _, pending = reply
            try:
                out = pending.result()
                reply = (seq, "ok", out if reply_output else None)
            except Exception as e:  # noqa: BLE001 - reported to the driver, which owns the decision
                reply = (seq, "error", type(e).__name__, str(e)[:2000])
        try:
            conn.send(reply)
        except OSError:
            return
