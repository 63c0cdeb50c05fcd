"""``raymoe bench routing``: prefix-aware against least-loaded DP routing on a multi-turn chat workload, one run.

Workload: ``--conversations`` chats of ``--turns`` turns each, every one opening with the same system prompt
(``--system-words`` words) and each turn adding a user message of its own (``--user-words`` words); turn k resends
the whole conversation so far, answers included (greedy, ``--max-tokens`` tokens), so a turn's prompt is its
conversation's previous prompt and answer plus one message. ``--concurrency`` conversations are in flight at once,
each sending its turns one after the other, streamed through the OpenAI chat API of an engine started here (driver
actor and rank actors on a loopback Ray, the app on 127.0.0.1).

Engines, in this order: dp=1 (one group holds every conversation: the best hit rate routing can reach, every turn
lands where its prefix is), then dp=``--dp`` with ``load_balance_method=shortest_queue`` and with ``prefix_aware``
(``raymoe.actors.dp_router``), then ``--serve-replicas`` dp=1 engines behind one Ray Serve ingress
(``build_app(engine_replicas=N)``) with Serve's default request router and with the prefix-aware one
(``raymoe.deploy.serve_router``). Reported per engine: the prefix-cache hit rate (prompt tokens served from the radix
cache over prompt tokens, from each response's ``usage.prompt_tokens_details.cached_tokens``), the same relative to
the dp=1 engine's, TTFT p50/p99, end-to-end p50 and the routing counters; the routed engines run ``--rounds``
times in alternating order, and the summary gives each method's mean hit rate and median TTFT p50. A benchmark:
it prints figures and writes JSON, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from pathlib import Path

from raymoe.bench.serve import RequestResult, stream_request


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """The options of ``raymoe bench routing``."""
    p.add_argument("--model", default=None, help="model folder (default: the demo checkpoint)")
    p.add_argument("--dp", type=int, default=2, help="DP-attention groups of the routed engines (ep = dp)")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=120, help="words of the shared system prompt")
    p.add_argument("--user-words", type=int, default=48, help="words of each user message")
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens per turn")
    p.add_argument("--concurrency", type=int, default=16, help="conversations in flight at once")
    p.add_argument("--kv-tokens", type=int, default=65536, help="KV slots per DP group (no eviction by default)")
    p.add_argument("--max-running-requests", type=int, default=32, help="per DP group")
    p.add_argument("--no-best", action="store_true", help="skip the dp=1 engine (no best-possible hit rate)")
    p.add_argument("--no-dp", action="store_true", help="skip the dp=--dp engines (only the Serve replicas)")
    p.add_argument("--serve-replicas", type=int, default=2,
                   help="also serve the workload from this many dp=1 engine replicas behind one Ray Serve ingress, "
                        "routed by Serve's default router and by the prefix-aware one (0: skip)")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each routed engine, the order alternating per round (the machine is noisy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/routing.json")


def conversations(a: argparse.Namespace) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each conversation's user messages (seeded words)."""
    from raymoe.bench.serve import _WORDS

    rng = random.Random(a.seed)
    system = "You are a careful assistant. " + " ".join(rng.choice(_WORDS) for _ in range(a.system_words))
    convs = [[f"Question {c}.{t}: " + " ".join(rng.choice(_WORDS) for _ in range(a.user_words))
              for t in range(a.turns)] for c in range(a.conversations)]
    return system, convs


async def _drive(base: str, model: str, system: str, convs: list[list[str]], a: argparse.Namespace
                 ) -> tuple[list[RequestResult], float]:
    import httpx

    common = {"model": model, "max_tokens": a.max_tokens, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=a.concurrency + 4, max_keepalive_connections=a.concurrency + 4)
    results: list[RequestResult] = []
    queue = list(reversed(convs))

    async def worker(client) -> None:
        while queue:
            turns = queue.pop()
            history = [{"role": "system", "content": system}]
            for turn in turns:
                history.append({"role": "user", "content": turn})
                res = await stream_request(client, f"{base}/v1/chat/completions", {**common, "messages": history})
                results.append(res)
                history = history + [{"role": "assistant", "content": res.text}]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(a.concurrency)))
    return results, time.perf_counter() - start


@contextlib.contextmanager
def _serve_app(a: argparse.Namespace, router: str):
    """``--serve-replicas`` dp=1 engines behind one Ray Serve ingress whose engine handle routes with ``router``;
    yields (URL, None)."""
    import httpx
    from ray import serve

    from raymoe.cli_args import resolve_model
    from raymoe.cluster.bootstrap import free_port, init_ray
    from raymoe.deploy.serve_app import build_app

    init_ray(None)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build_app({"model": resolve_model(a.model), "dp_size": 1, "ep_size": 1,
                         "max_total_tokens": a.kv_tokens, "max_context_len": 4096,
                         "max_running_requests": a.max_running_requests, "engine_replicas": a.serve_replicas,
                         "replica_router": router}), name="raymoe-bench-routing", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the Serve app did not become healthy within 600 s")
            time.sleep(1)
        yield url, None
    finally:
        serve.shutdown()


@contextlib.contextmanager
def _engine(a: argparse.Namespace, dp: int, method: str):
    """An engine with ``dp`` groups routing by ``method`` and the OpenAI app on 127.0.0.1; yields (URL, engine)."""
    from raymoe.cli_args import resolve_model
    from raymoe.client.engine_client import EngineClient
    from raymoe.config import engine_config_from_options
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.deploy.thread_server import serve_in_thread

    config = engine_config_from_options(resolve_model(a.model), {
        "dp_size": dp, "ep_size": dp, "max_total_tokens": a.kv_tokens, "max_context_len": 4096,
        "max_running_requests": a.max_running_requests, "load_balance_method": method})
    engine = EngineClient(config)
    try:
        with serve_in_thread(build_openai_app(engine)) as url:
            yield url, engine
    finally:
        engine.shutdown()


def _q(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))] * 1000.0


def run_one(a: argparse.Namespace, name: str, dp: int, method: str) -> dict:
    """Serve the workload on one engine; returns its figures."""
    import httpx
    import ray

    system, convs = conversations(a)
    serve_router = method.removeprefix("serve:") if method.startswith("serve:") else None
    server = _serve_app(a, serve_router) if serve_router else _engine(a, dp, method)
    with server as (url, engine):
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        results, wall = asyncio.run(_drive(url, model, system, convs, a))
        stats = ray.get(engine.driver.stats.remote(), timeout=60) if engine is not None else None
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    routing = stats.routing if stats is not None else None  # Serve rows: the router's counters are not exported
    return {
        "engine": name, "dp": dp, "method": method, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3], "wall_s": wall,
        "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "ttft_p50_ms": _q([r.ttft for r in ok], 0.5), "ttft_p99_ms": _q([r.ttft for r in ok], 0.99),
        "e2e_p50_ms": _q([r.latency for r in ok], 0.5),
        "routed_by_prefix": routing and routing.by_prefix, "routed_by_load": routing and routing.by_load,
        "load_capped": routing and routing.capped, "expected_cached_tokens": routing and routing.expected_cached_tokens,
    }


def format_table(rows: list[dict], best: float | None) -> str:
    """The figures as a fixed-width table (hit rate relative to the dp=1 engine's where it ran)."""
    head = (f"{'engine':<28}{'reqs':>6}{'err':>5}{'hit rate':>10}{'of best':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'e2e p50':>10}{'prefix/load/capped':>20}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rel = f"{r['hit_rate'] / best:.1%}" if best and r["hit_rate"] is not None else "-"
        routed = (f"{r['routed_by_prefix']}/{r['routed_by_load']}/{r['load_capped']}"
                  if r["dp"] > 1 and r["routed_by_prefix"] is not None else "-")
        lines.append(f"{r['engine']:<28}{r['requests']:>6}{r['errors']:>5}{r['hit_rate'] or 0:>10.1%}{rel:>9}"
                     f"{r['ttft_p50_ms'] or 0:>8.0f}ms{r['ttft_p99_ms'] or 0:>8.0f}ms{r['e2e_p50_ms'] or 0:>8.0f}ms"
                     f"{routed:>20}")
    return "\n".join(lines)


def summarize_rounds(rows: list[dict], best: float | None) -> dict:
    """Per routing method over the rounds of the routed engines: mean hit rate (and relative to ``best``), median
    TTFT p50 and e2e p50 (ms)."""
    out = {}
    for method in ("shortest_queue", "prefix_aware", "serve:power_of_two", "serve:prefix_aware"):
        mine = [r for r in rows if r["method"] == method and r["dp"] > 1 and r["hit_rate"] is not None]
        if not mine:
            continue
        hit = sum(r["hit_rate"] for r in mine) / len(mine)
        out[method] = {"rounds": len(mine), "hit_rate": hit, "of_best": hit / best if best else None,
                       "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine),
                       "e2e_p50_ms": statistics.median(r["e2e_p50_ms"] for r in mine)}
    return out


def run_routing_bench(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench routing``: run every engine, print the table, write the JSON."""
    from raymoe.cluster.bootstrap import use_loopback_environment

    use_loopback_environment()
    plan = [] if a.no_best else [("dp=1 (best possible)", 1, "shortest_queue")]
    routed = [] if a.no_dp else [(f"dp={a.dp} shortest_queue", a.dp, "shortest_queue"),
                                 (f"dp={a.dp} prefix_aware", a.dp, "prefix_aware")]
    if a.serve_replicas:
        n = a.serve_replicas
        routed += [(f"{n} Serve replicas power_of_two", n, "serve:power_of_two"),
                   (f"{n} Serve replicas prefix_aware", n, "serve:prefix_aware")]
    for r in range(a.rounds):
        plan += routed if r % 2 == 0 else routed[::-1]
    rows = []
    for name, dp, method in plan:
        print(f"--- {name}", flush=True)
        rows.append(run_one(a, name, dp, method))
        print(json.dumps(rows[-1]), flush=True)
    best = rows[0]["hit_rate"] if not a.no_best else None
    summary = summarize_rounds(rows, best)
    print(format_table(rows, best))
    for method, s in summary.items():
        print(f"{method:>15}: hit rate {s['hit_rate']:.1%}" + (f" ({s['of_best']:.1%} of best)" if best else "")
              + f", TTFT p50 median over {s['rounds']} rounds {s['ttft_p50_ms']:.0f} ms, e2e p50 "
              f"{s['e2e_p50_ms']:.0f} ms")
    report = {"args": {k: v for k, v in vars(a).items() if k != "func"}, "engines": rows, "best_hit_rate": best,
              "summary": summary}
    out = Path(a.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report
