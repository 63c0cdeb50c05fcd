"""Request heads are bounded whatever HTTP parser runs (README "Limits and failure behaviour"): a 64 MiB header is
refused with 431 within 2 s without growing the server process, more than ``max_headers`` header fields is a 431,
a CR, LF or NUL inside a header (or, with h11, a bare LF line end) is a 400 with the OpenAI error body and a request
id, and the same limits hold for a request that reaches the app through another server (``RequestGuard``). The
server runs in this process (tests/guarded_server.py, with the protocols of ``raymoe serve``) over a fake engine.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest
from fake_engine import FakeEngine
from guarded_server import guarded_server
from server_harness import metrics

from raymoe.deploy.server_config import ServerLimits

PARSERS = ["httptools", "h11"]


@pytest.fixture(scope="module")
def app(tiny_model):
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.tokenizer import load_tokenizer

    return build_openai_app(FakeEngine(load_tokenizer(tiny_model)), limits=ServerLimits(max_headers=20))


def _rss_mib(field: str = "VmRSS") -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _exchange(url: str, head: bytes, chunks=(), repeat: int = 0, end: bytes = b"\r\n") -> tuple[bytes, float]:
    """Send ``head``, ``chunks`` (``repeat`` times) and ``end`` from a thread while this one reads the answer until
    the server closes; (answer, seconds from the first byte sent to the end of the answer)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(30)

    def send():
        try:
            sock.sendall(head)
            for _ in range(repeat):
                for chunk in chunks:
                    sock.sendall(chunk)
            sock.sendall(end)
        except OSError:
            pass  # the server stopped reading: expected

    t0 = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    answer = b""
    try:
        while data := sock.recv(1 << 16):
            answer += data
    except OSError:
        pass
    elapsed = time.perf_counter() - t0
    sender.join(timeout=30)
    sock.close()
    return answer, elapsed


def _json_error(answer: bytes, status: int) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    assert headers[b"content-type"] == b"application/json"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code", "request_id"}
    assert err["request_id"] == headers[b"x-request-id"].decode()
    return err


@pytest.mark.parametrize("http", PARSERS)
def test_a_64_mib_header_is_refused_within_2_s_without_growing_the_process(app, http):
    chunk = b"a" * (1 << 20)  # sent 64 times: the client never holds the 64 MiB either
    with guarded_server(app, http=http) as url:
        _exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")  # warm the path
        before = _rss_mib()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
            peak_field = "VmHWM"
        except OSError:
            peak_field = "VmRSS"
        answer, elapsed = _exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: ", [chunk], repeat=64,
                                    end=b"\r\n\r\n")
        grown = _rss_mib(peak_field) - before
        errors = metrics(url)
    print(f"\n{http}: 64 MiB header answered in {elapsed:.3f} s; the process grew by {grown:.1f} MiB at its peak")
    err = _json_error(answer, 431)
    assert err["code"] == "request_header_too_large" and "65536 bytes" in err["message"]
    assert elapsed < 2.0 and grown < 8.0
    assert errors["raymoe:request_errors_total{status=431}"] >= 1


@pytest.mark.parametrize("http", PARSERS)
def test_too_many_headers_is_a_431(app, http):
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(25))
    with guarded_server(app, http=http) as url:
        answer, _ = _exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + many)
        ok, _ = _exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + many[:100])
    err = _json_error(answer, 431)
    assert err["code"] == "too_many_headers" and "20 header fields" in err["message"]
    assert ok.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("http", PARSERS)
@pytest.mark.parametrize("bad", [b"X-A: b\rc\r\n", b"X-A: b\x00c\r\n", b"X-\x00A: bc\r\n", b"X-A: b\nX-B: c\r\n",
                                 b"X-A: b\r\n c\r\n"])
def test_control_characters_in_headers_get_the_json_error_body(app, http, bad):
    with guarded_server(app, http=http) as url:
        answer, _ = _exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\n" + bad)
    err = _json_error(answer, 400)
    assert err["code"] == "invalid_http_request"


def test_the_app_applies_the_head_limits_under_any_server(app):
    """Through the ASGI interface alone (as under Ray Serve's proxy): the same 431s."""

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            many = await c.get("/health", headers={f"x-h{i}": "v" for i in range(25)})
            large = await c.get("/health", headers={"x-big": "a" * 70_000})
            fine = await c.get("/health", headers={"x-big": "a" * 1000})
            return many, large, fine

    many, large, fine = anyio.run(main)
    assert many.status_code == 431 and many.json()["error"]["code"] == "too_many_headers"
    assert large.status_code == 431 and large.json()["error"]["code"] == "request_header_too_large"
    assert large.json()["error"]["request_id"] == large.headers["x-request-id"]
    assert fine.status_code == 200
