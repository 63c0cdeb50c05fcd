"""Helpers for the HTTP server tests: uvicorn on 127.0.0.1 in a background thread, reading /metrics."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def uvicorn_server(app, timeout_s: float = 60.0, **config):
    """Serve ``app`` on 127.0.0.1 in a thread; a context manager yielding the base URL
    (``raymoe.deploy.thread_server.serve_in_thread``). ``config``: more ``uvicorn.Config`` arguments (``http``: the
    HTTP protocol class)."""
    from raymoe.deploy.thread_server import serve_in_thread

    return serve_in_thread(app, timeout_s=timeout_s, **config)


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
