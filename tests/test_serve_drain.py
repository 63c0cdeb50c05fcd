"""``raymoe serve`` stopped by SIGTERM while 16 completions stream, as Kubernetes, systemd or a user stop it: the
server process runs with its own local Ray (``serve_process``), the signal goes to that process.

- Default shutdown timeout (30 s): every stream runs to its end (``[DONE]``, all its tokens), ``/health`` answers
  503 ``draining`` and new requests 503 with ``Retry-After`` while the listener is still open, the process exits 0
  within the timeout and leaves no process of its tree (engine and Ray stopped).
- ``--shutdown-timeout 2`` with streams far longer than that: every stream ends with a ``server_shutdown`` error
  event and ``[DONE]``; none is cut.

The model is the tiny Qwen3-MoE with 12 layers instead of 4: decode steps take about 3x longer, so that 600 tokens
outlast the 2 s before the signal with a margin on this 2-core machine (with 4 layers 16 streams end in about
2.2 s here, and on a faster machine before the signal).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import psutil
import pytest
from serve_process import StreamResult, serve_process, stream_completion
from test_loopback import process_tree

STREAMS = 16


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> str:
    from raymoe.models.checkpoint import make_checkpoint

    return str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe_12l", seed=0,
                               num_layers=12))


async def _watch_drain(url: str) -> list[tuple[str, int, str, str | None]]:
    """Until the listener closes: ``/health`` and a new completion every 0.2 s, as ``(what, status, status or
    error code, Retry-After)``."""
    seen = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        while True:
            try:
                r = await c.get("/health")
                seen.append(("health", r.status_code, r.json().get("status"), r.headers.get("retry-after")))
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
                code = r.json()["error"]["code"] if r.status_code != 200 else "ok"
                seen.append(("new", r.status_code, code, r.headers.get("retry-after")))
            except httpx.TransportError:
                return seen
            await asyncio.sleep(0.2)


async def _stream_and_signal(url: str, pid: int, max_tokens: int, signal_after_s: float):
    """Start the streams, send SIGTERM ``signal_after_s`` after they all got their first tokens, watch the drain;
    returns (results, results' finish reasons at the signal, what the watcher saw, monotonic time of the signal)."""
    results = [StreamResult() for _ in range(STREAMS)]
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as c:
        tasks = [asyncio.create_task(stream_completion(c, max_tokens, r)) for r in results]
        deadline = time.monotonic() + 60
        while not all(r.chunks or r.failure for r in results):
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.02)
        await asyncio.sleep(signal_after_s)
        at_signal = [r.finish_reason for r in results]
        os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        watched = await _watch_drain(url)
        await asyncio.gather(*tasks)
    return results, at_signal, watched, signalled


def _wait_gone(tree: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    return alive


def test_sigterm_drains_every_stream_to_its_end(deep_model):
    with serve_process(deep_model, "--max-total-tokens", "20000") as server:
        tree = [psutil.Process(p) for p in process_tree(server.proc.pid) if p != server.proc.pid]
        results, at_signal, watched, signalled = asyncio.run(
            _stream_and_signal(server.url, server.proc.pid, 600, signal_after_s=2.0))
        rc = server.proc.wait(timeout=90)
        exit_s = time.monotonic() - signalled
        log = server.log()
    print(log[-1500:], f"\nexit {rc} after {exit_s:.1f} s; watcher saw {watched[:4]} ... {len(watched)} answers")
    assert at_signal == [None] * STREAMS, "a stream ended before the signal: the test would not test the drain"
    for r in results:
        assert r.failure is None and r.errors == [], r
        assert r.done and r.finish_reason == "length" and r.completion_tokens == 600, r
    assert ("health", 503, "draining", "5") in watched, watched
    assert ("new", 503, "server_shutdown", "5") in watched, watched
    assert not any(s == 200 for _, s, _, _ in watched), watched
    assert rc == 0 and exit_s < 30, (rc, exit_s)
    assert re.search(rf"{STREAMS} requests in flight, {STREAMS} finished, 0 cut", log), log[-2000:]
    assert "stopped" in log
    assert not _wait_gone(tree, 15), "processes of the server's tree outlived it"


def test_shutdown_timeout_ends_long_streams_with_an_error_event(deep_model):
    with serve_process(deep_model, "--max-total-tokens", "40000", "--shutdown-timeout", "2") as server:
        results, at_signal, watched, signalled = asyncio.run(
            _stream_and_signal(server.url, server.proc.pid, 2000, signal_after_s=0.5))
        rc = server.proc.wait(timeout=90)
        exit_s = time.monotonic() - signalled
        log = server.log()
    print(log[-1500:], f"\nexit {rc} after {exit_s:.1f} s; chunks {[r.chunks for r in results]}")
    assert at_signal == [None] * STREAMS
    for r in results:
        assert r.failure is None, r  # not cut: the connection ended after [DONE]
        assert r.errors == ["server_shutdown"] and r.done, r
        assert r.finish_reason is None and 0 < r.chunks < 2000, r
    assert ("health", 503, "draining", "5") in watched, watched
    assert rc == 0 and exit_s < 30, (rc, exit_s)
    assert re.search(rf"{STREAMS} requests in flight, 0 finished, {STREAMS} cut", log), log[-2000:]
