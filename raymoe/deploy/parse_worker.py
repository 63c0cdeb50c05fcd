"""A body-parsing worker process: ``python -m raymoe.deploy.parse_worker`` (started by ``parse_pool``).

It reads requests from stdin and writes answers to stdout, one at a time, until stdin closes (its parent is gone).
The body itself is not sent through the pipe: the parent writes it into a shared in-memory file (``memfd``, its
descriptor number is the worker's only argument) with one ``pwritev`` call, and the worker reads it with one
``pread``. A 15 MB body through a 64 KiB pipe took some 240 writes, and the parent's writing thread took the GIL
back after each of them, which delayed the parent's event loop.

- request: a header ``struct "<BII"`` (1 for a chat completion else 0, length of the pickled ``BodyLimits``,
  length of the body in the shared file), then the pickled limits;
- answer: ``struct "<I"`` (length), then the pickled result of ``body_parse.parse_body`` (a request model or a
  ``Refusal``), or of the string ``"error"`` when parsing raised (the traceback goes to stderr, the server log).

It imports only the light parsing modules (msgspec, pydantic, the request models): no torch, no Ray, no FastAPI,
so it starts in a fraction of a second and holds tens of MB. It runs at a lower CPU priority (``nice`` +10) than
the front end, so on a busy machine parsing a client's huge body yields to the streams being served. Its own
stdout is moved to stderr, so nothing it prints can corrupt the answers, and it ignores SIGINT (a Ctrl-C in the
server's terminal reaches the whole process group): it ends when its stdin closes.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import traceback

REQUEST_HEADER = struct.Struct("<BII")
ANSWER_HEADER = struct.Struct("<I")
READY = b"R"
# Added to a worker's nice value: its CPU share yields to the front end's on a busy machine.
NICENESS = 10


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd`` (None at end of file)."""
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(fd_in: int, fd_out: int, fd_body: int) -> None:
    """Answer requests from ``fd_in`` on ``fd_out`` until ``fd_in`` closes; bodies are read from ``fd_body``."""
    from raymoe.deploy.body_parse import parse_body

    _write_all(fd_out, READY)
    while True:
        header = _read_exact(fd_in, REQUEST_HEADER.size)
        if header is None:
            return
        chat, limits_len, body_len = REQUEST_HEADER.unpack(header)
        limits = _read_exact(fd_in, limits_len)
        if limits is None:
            return
        body = os.pread(fd_body, body_len, 0)
        try:
            result = parse_body(body, bool(chat), pickle.loads(limits))
        except Exception:  # noqa: BLE001 - report it, keep serving
            traceback.print_exc(file=sys.stderr)
            result = "error"
        del body
        answer = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        _write_all(fd_out, ANSWER_HEADER.pack(len(answer)) + answer)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICENESS)
    fd_in, fd_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # print() goes to stderr from now on
    sys.stdout = sys.stderr
    try:
        serve(fd_in, fd_out, int(sys.argv[1]))
    except BrokenPipeError:
        pass  # the front end is gone


if __name__ == "__main__":
    main()
