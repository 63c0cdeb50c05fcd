"""Helpers for the HTTP server tests: uvicorn on 127.0.0.1 in a background thread, reading /metrics."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


@contextlib.contextmanager
def uvicorn_server(app, timeout_s: float = 60.0, **config):
    """Serve ``app`` on 127.0.0.1 in a thread; yields the base URL; stops the server on exit. ``config``: more
    ``uvicorn.Config`` arguments (``http``: the HTTP protocol class).

    The listening socket is bound here (port 0: the kernel picks a free one) and handed to uvicorn, so no other
    process (a second copy of the suite, say) can take the port between choosing and binding it.

    Raises:
        RuntimeError: uvicorn did not start within ``timeout_s`` seconds.
    """
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{label=value,...}": value}`` (labels sorted, model_name left out)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.1):
    """Poll ``predicate()`` until it returns a truthy value; returns it (raises TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(interval_s)


def engine_idle(base_url: str) -> bool:
    """No request running or waiting and no KV in use (cached prefixes count as free)."""
    m = metrics(base_url)
    return (m["raymoe:num_requests_running"] == 0 and m["raymoe:num_requests_waiting"] == 0
            and m["raymoe:kv_cache_usage_perc"] == 0)


def dashboard_metrics(path: str = "dashboards/raymoe.json") -> set[str]:
    """Every ``raymoe:`` series name the Grafana dashboard's queries (and variables) read."""
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parent.parent / path).read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return {m for e in exprs for m in re.findall(r"raymoe:[A-Za-z0-9_:]+", e)}


def exported_names(text: str) -> tuple[set[str], set[str]]:
    """(sample names with a value, names of declared families incl. their histogram/counter series) of an
    exposition ``text``."""
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    declared = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(kind, ("",))
            declared |= {name + s for s in suffixes} | {name}
    return samples, declared
