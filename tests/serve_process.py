"""Helpers for tests that run ``raymoe serve`` as its own process (as a user or Kubernetes starts it) and stream
completions from it: start and wait until healthy, read one stream's events."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
from test_loopback import stop_process_tree

from raymoe.cluster.bootstrap import free_port

_SESSION_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "GLOO_SOCKET_IFNAME", "RAY_ADDRESS")


@dataclass
class ServeProcess:
    """A running ``raymoe serve``: its process, URL and log file (stdout and stderr)."""

    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def serve_process(model: str, *flags: str, start_timeout_s: float = 240.0):
    """Start ``raymoe serve --model model --dp 1 FLAGS`` on a free loopback port with its own local Ray (in a fresh
    temp dir), wait until ``/health`` answers 200, yield a :class:`ServeProcess`; stop what is left on exit."""
    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rmd-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in _SESSION_ENV}
    env["RAY_TMPDIR"] = ray_tmp
    cmd = [sys.executable, "-m", "raymoe.cli", "serve", "--model", model, "--served-model-name", "tiny", "--dp", "1",
           "--port", str(port), "--log-level", "warning", *flags]
    log_path = os.path.join(ray_tmp, "serve.log")  # a file, not a pipe: nobody reads while it serves
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            assert proc.poll() is None, f"raymoe serve exited:\n{server.log()[-3000:]}"
            assert time.monotonic() < deadline, "raymoe serve did not become healthy"
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield server
    finally:
        stop_process_tree(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@dataclass
class StreamResult:
    """What one streamed completion delivered.

    Attributes:
        chunks: token chunks received. finish_reason: of the last choice chunk (None: never finished).
        completion_tokens: from the usage chunk (None: no usage chunk). errors: the ``code`` of each error event.
        done: ``data: [DONE]`` was received. failure: the exception that ended the stream (a cut connection).
        sent, first_token: ``time.monotonic()`` when the request was sent and its first token arrived.
    """

    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    errors: list[str] = field(default_factory=list)
    done: bool = False
    failure: str | None = None
    sent: float = 0.0
    first_token: float | None = None


async def stream_completion(client: httpx.AsyncClient, max_tokens: int, result: StreamResult) -> StreamResult:
    """Stream one ``ignore_eos`` completion of ``max_tokens`` tokens, filling ``result`` as events arrive (so a
    caller can look at it mid-stream); a transport error is recorded in ``failure``, never raised."""
    body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    result.sent = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.failure = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.errors.append(event["error"]["code"])
                elif event.get("usage") and not event.get("choices"):
                    result.completion_tokens = event["usage"]["completion_tokens"]
                else:
                    result.first_token = result.first_token or time.monotonic()
                    result.chunks += 1
                    result.finish_reason = event["choices"][0]["finish_reason"] or result.finish_reason
    except httpx.HTTPError as e:
        result.failure = type(e).__name__
    return result
