"""uvicorn's HTTP/1.1 protocols with a bounded request head, and JSON error bodies for requests they cannot parse.

uvicorn's parsers put no bound on the request head: httptools appends every fragment of a header value to the
bytes it holds so far (a 64 MiB ``X-Request-Id`` was accepted after 5 s, its parse time growing about
quadratically with its size, and eight such heads at once doubled the server's memory), and neither parser
limits the header count. A parse error (a CR, LF or NUL inside a header, a bad request line) is answered with
uvicorn's plain-text 400, without a request id.

:func:`guarded_http_protocol` subclasses the protocol uvicorn would pick (httptools when installed, else h11;
or the one named) so that:

- the bytes a request head has received are counted before the parser sees them; once they pass
  ``max_header_bytes`` and the head is still incomplete, the client gets 431 and the connection is closed, so the
  parser never holds more than the limit plus one socket read (at most 256 KiB in asyncio);
- a header past ``max_headers`` is a 431 as soon as the parser reports it (httptools; h11 reports the head
  whole, which ``http_guard.RequestGuard`` then counts);
- a request the parser refuses gets the OpenAI error body of ``http_errors`` with a request id (logged), 400;
  with h11, which accepts a bare LF as a line end and a folded header line, these are refused the same way.

After such an answer the connection is half-closed and what the client still sends is read and dropped for up to
:data:`LINGER_S` before the socket is closed: closing a socket with unread bytes makes the kernel reset the
connection, and a client still sending its 64 MiB header would then lose the answer too.

The same limits are checked again on every request that reaches the app (``http_guard``), whatever server runs
it, so under a server that does not use these protocols (Ray Serve's proxy) the answers are the same, though the
proxy's parser has then read the whole head.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from raymoe.deploy.http_errors import APIError

log = logging.getLogger(__name__)

_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}
# A bare LF, or a line folded onto the previous one (obs-fold, which h11 accepts and httptools refuses).
_BAD_LINE = re.compile(rb"(?<!\r)\n|\r\n[ \t]")
_HEAD_END = b"\r\n\r\n"
# How long a refused connection keeps reading (and dropping) what its client still sends, seconds.
LINGER_S = 1.0
# h11 buffers a head until it is complete and refuses it past this many bytes over our limit, so that our own
# count (431, JSON) answers first.
_H11_SLACK = 1 << 18


class _HeadGuard:
    """What both guarded protocols share: the limits and the error answer written on the raw transport."""

    max_header_bytes: int
    max_headers: int
    on_refusal: Callable[[int], None] | None
    _refused = False  # an error answer was sent: what arrives now is dropped

    def _answering(self) -> bool:
        """A response to an earlier request of this connection is being written (pipelining)."""
        raise NotImplementedError

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with the OpenAI error body and close the connection (only close it when a response
        is already under way: our bytes would corrupt it)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._refused:
            return
        self._refused = True
        request_id = uuid.uuid4().hex
        log.warning("request %s refused before it reached the app: %d %s", request_id, status, message)
        if self.on_refusal is not None:
            self.on_refusal(status)
        if self._answering():
            transport.close()
            return
        body = json.dumps(APIError(status, message, code=code).body(request_id)).encode()
        transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                        b"x-request-id: %s\r\nconnection: close\r\n\r\n%s"
                        % (status, _REASONS[status], len(body), request_id.encode(), body))
        if transport.can_write_eof():
            transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)

    def _head_too_large(self) -> None:
        self._refuse(431, f"the request head (request line and headers) is larger than {self.max_header_bytes} "
                          f"bytes", "request_header_too_large")

    def _too_many_headers(self) -> None:
        self._refuse(431, f"at most {self.max_headers} header fields are allowed", "too_many_headers")

    def _malformed(self) -> None:
        self._refuse(400, "malformed HTTP request: the request line or a header is invalid (CR, LF or NUL inside "
                          "a header, a bare LF as a line end, a folded header line, an invalid character)",
                     "invalid_http_request")


class _TooManyHeaders(Exception):
    """Raised in httptools' header callback to stop the parser."""


def _httptools_protocol():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_HeadGuard, HttpToolsProtocol):
        """httptools with a bounded head (see the module docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._head_open = True  # the bytes arriving belong to a request head
            self._head_bytes = 0
            self._header_overflow = False

        def _answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            counted = self._head_open
            if counted:
                self._head_bytes += len(data)
            super().data_received(data)
            if counted and self._head_open and self._head_bytes > self.max_header_bytes:
                self._head_too_large()

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            if len(self.headers) > self.max_headers:
                self._header_overflow = True
                raise _TooManyHeaders

        def on_headers_complete(self) -> None:
            self._head_open = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head_open, self._head_bytes = True, 0

        def send_400_response(self, msg: str) -> None:
            if self._header_overflow:
                self._too_many_headers()
            else:
                self._malformed()

    return GuardedHttpToolsProtocol


class GuardedH11Protocol(_HeadGuard, H11Protocol):
    """h11 with a bounded head and neither a bare LF nor a folded line in it (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_header_bytes + _H11_SLACK)
        self._head = bytearray()  # the bytes of the head being received (at most the limit plus one read)

    def _answering(self) -> bool:
        return self.conn.our_state is h11.SEND_BODY

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is not h11.IDLE:
            self._head.clear()
            return super().data_received(data)
        self._head += data
        end = self._head.find(_HEAD_END)
        lf = _BAD_LINE.search(self._head, 0, len(self._head) if end < 0 else end + len(_HEAD_END))
        if lf is not None:
            return self._malformed()
        if end < 0 and len(self._head) > self.max_header_bytes:
            return self._head_too_large()
        if end >= 0:
            self._head.clear()
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        self._malformed()


def guarded_http_protocol(max_header_bytes: int, max_headers: int, http: str = "auto",
                          on_refusal: Callable[[int], None] | None = None) -> type:
    """The uvicorn HTTP protocol class to pass as ``uvicorn.Config(http=...)``.

    Args:
        max_header_bytes: largest request head, bytes (431 beyond). max_headers: most header fields (431 beyond).
        http: ``"auto"`` (httptools when installed, else h11), ``"httptools"`` or ``"h11"``.
        on_refusal: called with the status of each answer sent here (the app never sees these requests), e.g.
            ``ServerMetrics.error``.

    Raises:
        ValueError: an unknown ``http``.
    """
    if http == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            http = "h11"
        else:
            http = "httptools"
    if http == "httptools":
        base = _httptools_protocol()
    elif http == "h11":
        base = GuardedH11Protocol
    else:
        raise ValueError(f"http must be 'auto', 'httptools' or 'h11', got {http!r}")
    return type(base.__name__, (base,), {"max_header_bytes": max_header_bytes, "max_headers": max_headers,
                                        "on_refusal": staticmethod(on_refusal) if on_refusal else None})
