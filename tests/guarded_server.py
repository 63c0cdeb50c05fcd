"""uvicorn on 127.0.0.1 in a background thread with the HTTP protocol of ``raymoe serve`` (the bounded request head
of ``raymoe.deploy.http_protocol``), for the tests of heads and bodies under a real server."""

from __future__ import annotations

import contextlib

from server_harness import uvicorn_server


@contextlib.contextmanager
def guarded_server(app, http: str = "auto", timeout_s: float = 60.0):
    """Serve ``app`` (built by ``build_openai_app``) as ``raymoe serve`` does, with the parser ``http`` (see
    ``guarded_http_protocol``); yields the base URL; stops the server on exit.

    Raises:
        RuntimeError: uvicorn did not start within ``timeout_s`` seconds.
    """
    from raymoe.deploy.http_protocol import guarded_http_protocol

    limits = app.state.serving.limits
    protocol = guarded_http_protocol(limits.max_header_bytes, limits.max_headers, http=http,
                                     on_refusal=app.state.serving.metrics.error)
    with uvicorn_server(app, timeout_s, http=protocol) as url:
        yield url
