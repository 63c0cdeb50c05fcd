"""uvicorn on 127.0.0.1 in a background thread with the HTTP protocol of ``raymoe serve`` (the bounded request head
of ``raymoe.deploy.http_protocol``), for the tests of heads and bodies under a real server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def guarded_server(app, http: str = "auto", timeout_s: float = 60.0):
    """Serve ``app`` (built by ``build_openai_app``) as ``raymoe serve`` does, with the parser ``http`` (see
    ``guarded_http_protocol``); yields the base URL; stops the server on exit.

    Raises:
        RuntimeError: uvicorn did not start within ``timeout_s`` seconds.
    """
    import uvicorn

    from raymoe.deploy.http_protocol import guarded_http_protocol

    limits = app.state.serving.limits
    protocol = guarded_http_protocol(limits.max_header_bytes, limits.max_headers, http=http,
                                     on_refusal=app.state.serving.metrics.error)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; uvicorn gets the bound socket
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="guarded-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
