"""An ASGI app served by uvicorn on 127.0.0.1 in a background thread of this process: what the benchmarks that
drive a served engine in process (``raymoe bench chaos``, ``raymoe bench stress``) and the HTTP tests use."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def serve_in_thread(app, *, sock: socket.socket | None = None, timeout_s: float = 60.0, **config) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL (``http://127.0.0.1:PORT``).

    The listening socket is bound before uvicorn starts (port 0: the kernel picks a free one) and handed to it, so no
    other process can take the port between choosing and binding it.

    Args:
        app: the ASGI app. sock: a socket bound on 127.0.0.1 to listen on (its options set by the caller; None: a
            fresh one). timeout_s: bound on uvicorn's start, seconds. config: more ``uvicorn.Config`` arguments
            (``http``, ``backlog``, ...; ``log_level`` defaults to warning, ``timeout_graceful_shutdown`` to 2 s).

    Raises:
        RuntimeError: uvicorn did not start within ``timeout_s`` seconds (or its thread ended).
    """
    import uvicorn

    if sock is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
    config = {"log_level": "warning", "timeout_graceful_shutdown": 2, **config}
    server = uvicorn.Server(uvicorn.Config(app, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="raymoe-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
