"""``raymoe bench stress``: many concurrent short streams (some clients hanging up), then "nothing lost".

Starts an engine on a local loopback Ray (driver actor + rank actors, the OpenAI app on 127.0.0.1) unless
``--base-url`` names a running server, opens ``--streams`` streaming completions at once (``--max-tokens`` each;
a ``--disconnect-fraction`` of the clients hang up after a random number of chunks), and prints: requests
completed, errors by kind, disconnects, p50/p99 latency, the engine's idle invariant afterwards, and the resident
memory of the engine's processes before and after. A benchmark: it prints figures and writes JSON, it asserts
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from pathlib import Path


def add_stress_args(p: argparse.ArgumentParser) -> None:
    """The options of ``raymoe bench stress``."""
    p.add_argument("--model", default=None, help="model folder (default: the demo checkpoint)")
    p.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    p.add_argument("--dp", type=int, default=2, help="DP-attention groups of the engine started here")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--streams", type=int, default=5000, help="concurrent streaming requests")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--disconnect-fraction", type=float, default=0.2,
                   help="fraction of clients that hang up after a random number of chunks")
    p.add_argument("--max-running-requests", type=int, default=128, help="per DP group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on the whole run, seconds")
    p.add_argument("--output-json", default="bench_results/stress.json")


async def _one(client, model: str, i: int, max_tokens: int, hang_up_after: int | None) -> tuple[str, float]:
    """One streaming completion; returns (outcome, seconds). Outcome: "ok", "disconnect", "http_<status>",
    "sse_<code>" or "exception_<type>"."""
    body = {"model": model, "prompt": f"x = {i % 997}", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    outcome = "ok"
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}", time.perf_counter() - t0
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome = f"sse_{event['error'].get('code') or event['error'].get('type')}"
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return "disconnect", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - counted by kind
        outcome = f"exception_{type(e).__name__}"
    return outcome, time.perf_counter() - t0


async def _load(base_url: str, model: str, a: argparse.Namespace) -> list[tuple[str, float]]:
    import httpx

    rng = random.Random(a.seed)
    plan = [rng.randint(1, a.max_tokens) if rng.random() < a.disconnect_fraction else None
            for _ in range(a.streams)]
    limits = httpx.Limits(max_connections=a.streams + 16, max_keepalive_connections=a.streams + 16)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(a.timeout_s)) as client:
        return await asyncio.wait_for(
            asyncio.gather(*(_one(client, model, i, a.max_tokens, h) for i, h in enumerate(plan))), a.timeout_s)


def _rss_mib(pids: list[int]) -> float:
    import psutil

    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total / 2**20


def _engine_pids(engine) -> list[int]:
    import os

    import ray

    return [os.getpid(), *ray.get(engine.driver.pids.remote(), timeout=60)]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@contextlib.contextmanager
def _local_server(a: argparse.Namespace):
    """An engine and the OpenAI app on 127.0.0.1 in this process; yields (base URL, engine)."""
    from raymoe.cli_args import resolve_model
    from raymoe.client.engine_client import EngineClient
    from raymoe.config import engine_config_from_options
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.deploy.thread_server import serve_in_thread

    config = engine_config_from_options(resolve_model(a.model), {
        "dp_size": a.dp, "tp_size": a.tp, "ep_size": a.dp * a.tp, "max_running_requests": a.max_running_requests,
        "max_queued_requests": a.streams})
    engine = EngineClient(config)
    app = build_openai_app(engine, max_in_flight=a.streams + 16)
    try:
        with serve_in_thread(app, backlog=a.streams + 64) as url:
            yield url, engine
    finally:
        engine.shutdown()


def run_stress(a: argparse.Namespace) -> dict:
    """Run the stress benchmark described by ``a``; prints the figures and writes ``a.output_json``."""
    import httpx

    from raymoe.cluster.bootstrap import use_loopback_environment

    use_loopback_environment()
    with contextlib.ExitStack() as stack:
        if a.base_url:
            base_url, engine = a.base_url, None
        else:
            base_url, engine = stack.enter_context(_local_server(a))
        model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        rss_before = _rss_mib(_engine_pids(engine)) if engine else None
        t0 = time.perf_counter()
        results = asyncio.run(_load(base_url, model, a))
        wall = time.perf_counter() - t0
        idle = None
        if engine is not None:
            import ray

            deadline = time.monotonic() + 60
            while True:
                stats = ray.get(engine.driver.stats.remote(), timeout=60)
                if (stats.num_running == stats.num_waiting == 0 and stats.idle_checked) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            idle = {"kv_leaked_slots": stats.kv_leaked_slots, "req_rows_leaked": stats.req_rows_leaked,
                    "cache_tokens_locked": stats.cache_tokens_locked, "idle": stats.idle_checked}
        rss_after = _rss_mib(_engine_pids(engine)) if engine else None
    kinds = Counter(outcome for outcome, _ in results)
    latencies = [s for outcome, s in results if outcome == "ok"]
    report = {
        "streams": a.streams, "max_tokens": a.max_tokens, "completed": kinds.get("ok", 0),
        "disconnected": kinds.get("disconnect", 0),
        "errors_by_kind": {k: v for k, v in sorted(kinds.items()) if k not in ("ok", "disconnect")},
        "p50_latency_s": _percentile(latencies, 0.50), "p99_latency_s": _percentile(latencies, 0.99),
        "wall_s": wall, "idle_invariant": idle, "rss_mib_before": rss_before, "rss_mib_after": rss_after,
    }
    print(f"streams {a.streams} (max_tokens {a.max_tokens}): completed {report['completed']}, "
          f"disconnected {report['disconnected']}, errors {report['errors_by_kind'] or 'none'}")
    print(f"latency p50 {report['p50_latency_s']:.3f} s, p99 {report['p99_latency_s']:.3f} s; wall {wall:.1f} s")
    if idle is not None:
        print(f"idle invariant: {idle}")
    if rss_before is not None:
        print(f"engine RSS: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after")
    out = Path(a.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report
