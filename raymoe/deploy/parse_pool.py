"""Parse worker processes: where the front end parses every request body that is not short.

Parsing and validating JSON holds the GIL for as long as it runs (msgspec, pydantic and ``json`` are C or Rust
code that never releases it), so a 15 MB body parsed in a thread of the front end's process would stall its
event loop, and every stream it serves, for the whole parse. A parse in another process costs the front end only
the hand-over: a thread writes the body's chunks into an in-memory file the worker shares with one ``pwritev``
(the GIL is released while it copies; the chunks are never joined), and a small answer comes back through a pipe
(a request model whose chat messages are one string each, or a refusal).

:func:`parse_request` is the entry point: a body of at most :data:`INLINE_PARSE_MAX_BODY_BYTES` is parsed on the
event loop (well under 1 ms at its worst shape, measured: 0.4-0.5 ms for 16 KiB of token ids or empty text
parts), any other in a worker of the process-wide :class:`ParsePool`, through one thread per worker.

The pool has :func:`pool_size` workers (half the CPUs this process may run on, 1 to 4), started on first use
(``python -m raymoe.deploy.parse_worker``, about 0.5 s; ``build_openai_app`` starts them in the background). A
worker that dies is replaced on the next request; the request it held gets ``ParseWorkerError`` (a 500, logged).
Workers exit when the front end does (their stdin closes).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import anyio

from raymoe.deploy.body_limits import BodyLimits, Refusal
from raymoe.deploy.body_parse import parse_body
from raymoe.deploy.parse_worker import ANSWER_HEADER, READY, REQUEST_HEADER, _read_exact, _write_all
from raymoe.deploy.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

# Largest body parsed on the event loop (bytes): parsing 16 KiB of the most expensive shape (tiny text parts, or
# one-digit token ids) took 0.4-0.5 ms, about what the hand-over to a worker costs in CPU; a larger body goes to a
# worker process.
INLINE_PARSE_MAX_BODY_BYTES = 16 * 1024
# Most buffers one pwritev call takes (the system's IOV_MAX).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class ParseWorkerError(RuntimeError):
    """A parse worker died or failed while it held a body (the front end answers 500 and logs it)."""


def pool_size() -> int:
    """Workers of the pool: half the CPUs this process may run on, at least 1 and at most 4."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 2
    return max(1, min(4, cpus // 2))


def _shared_file() -> int:
    """A descriptor of an in-memory file a worker inherits (``memfd``; a temporary file where there is none)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("raymoe-parse-body", 0)  # not close-on-exec: the worker inherits it
    import tempfile

    fd = os.dup(tempfile.TemporaryFile().fileno())
    os.set_inheritable(fd, True)
    return fd


def _write_chunks(fd: int, chunks: list[bytes]) -> int:
    """Write ``chunks`` at the start of the file ``fd``, at most ``_IOV_MAX`` per system call; their total size."""
    offset = 0
    for i in range(0, len(chunks), _IOV_MAX):
        batch = chunks[i:i + _IOV_MAX]
        size = sum(len(c) for c in batch)
        written = os.pwritev(fd, batch, offset)
        if written != size:  # a short write (the file system is full?): the rest with plain writes
            rest = b"".join(batch)
            while written < size:
                written += os.pwrite(fd, rest[written:], offset + written)
        offset += size
    return offset


class _Worker:
    """One worker process, its pipes and its shared body file (used by one thread at a time)."""

    def __init__(self):
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the raymoe package
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.fd_body = _shared_file()
        self.proc = subprocess.Popen([sys.executable, "-m", "raymoe.deploy.parse_worker", str(self.fd_body)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     pass_fds=(self.fd_body,))
        self.fd_in, self.fd_out = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        self.ready = False

    def call(self, chunks: list[bytes], chat: bool, limits: BodyLimits):
        """Parse the body made of ``chunks`` in this worker (blocking; the GIL is released while the body is copied
        and while the pipes are read and written).

        Raises:
            ParseWorkerError: the worker died or failed.
        """
        try:
            if not self.ready:
                if _read_exact(self.fd_in, len(READY)) != READY:
                    raise ParseWorkerError("the parse worker did not start")
                self.ready = True
            size = _write_chunks(self.fd_body, chunks)
            packed = pickle.dumps(limits)
            _write_all(self.fd_out, REQUEST_HEADER.pack(int(chat), len(packed), size) + packed)
            header = _read_exact(self.fd_in, ANSWER_HEADER.size)
            answer = header and _read_exact(self.fd_in, ANSWER_HEADER.unpack(header)[0])
            if size > INLINE_PARSE_MAX_BODY_BYTES:
                os.ftruncate(self.fd_body, 0)  # give back the pages of a large body
        except OSError as e:
            raise ParseWorkerError(f"the parse worker's pipe failed: {e}") from e
        if not answer:
            raise ParseWorkerError(f"the parse worker exited (status {self.proc.poll()})")
        result = pickle.loads(answer)
        if result == "error":
            raise ParseWorkerError("the parse worker failed on a body (its traceback is in the server log)")
        return result

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        os.close(self.fd_body)
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ParsePool:
    """A fixed number of parse worker processes shared by every app of this process.

    Args:
        size: worker processes.
    """

    def __init__(self, size: int):
        self.size = size
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._limiters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def start(self) -> None:
        """Start the missing workers (idempotent; they finish importing in the background)."""
        with self._lock:
            while len(self._workers) < self.size:
                worker = _Worker()
                self._workers.append(worker)
                self._idle.put(worker)

    def pids(self) -> list[int]:
        """The process ids of the current workers."""
        with self._lock:
            return [w.proc.pid for w in self._workers]

    def parse(self, chunks: list[bytes], chat: bool, limits: BodyLimits):
        """Parse the body made of ``chunks`` in a worker (blocking: call it from a thread). See
        ``body_parse.parse_body``.

        Raises:
            ParseWorkerError: the worker died or failed (it is replaced).
        """
        self.start()
        worker = self._idle.get()
        try:
            result = worker.call(chunks, chat, limits)
        except ParseWorkerError:
            with self._lock:
                self._workers.remove(worker)
            worker.close()
            self.start()  # its replacement, for the threads waiting for a worker
            raise
        self._idle.put(worker)
        return result

    def limiter(self) -> anyio.CapacityLimiter:
        """This event loop's limit on threads waiting for a worker: one per worker (more would only queue)."""
        import asyncio

        loop = asyncio.get_running_loop()
        limiter = self._limiters.get(loop)
        if limiter is None:
            limiter = self._limiters[loop] = anyio.CapacityLimiter(self.size)
        return limiter

    def close(self) -> None:
        """Stop every worker."""
        with self._lock:
            workers, self._workers = self._workers, []
            self._idle = queue.SimpleQueue()
        for worker in workers:
            worker.close()


POOL = ParsePool(pool_size())
"""The process-wide pool (workers start on first use)."""
atexit.register(POOL.close)


async def parse_request(chunks: list[bytes], chat: bool, limits: BodyLimits) -> CompletionRequest | \
        ChatCompletionRequest | Refusal:
    """Parse a request body, given as the chunks it arrived in: on the loop when it is short, else in a parse worker
    process (see the module docstring).

    Raises:
        ParseWorkerError: the worker died or failed.
    """
    if sum(len(c) for c in chunks) <= INLINE_PARSE_MAX_BODY_BYTES:
        return parse_body(b"".join(chunks), chat, limits)
    return await anyio.to_thread.run_sync(POOL.parse, chunks, chat, limits, limiter=POOL.limiter())
