"""``raymoe bench pd``: prefill/decode disaggregation against a colocated engine, one run.

(a) The KV transfer itself: ``raymoe bench kv-transfer`` (NIXL and the gloo fallback against a memcpy of the same
    bytes), unless ``--no-transfer``.
(b) Decode inter-token latency under long-prompt arrivals: ``--decoders`` streams of ``--decode-tokens`` tokens
    each (short prompts) run while long prompts (``--long-words`` words, ``--long-tokens`` answer tokens) arrive at
    ``--long-rate`` per second (Poisson, seeded), on a colocated dp=``--dp`` ep=``--dp`` engine with MIXED batches
    (a prefill shares the step with every running decode) and on ``--pd-prefill`` + ``--pd-decode`` engines
    (``raymoe.client.pd_client``), each with the OpenAI app on 127.0.0.1. Reported: the decode streams' ITL
    p50/p99 (gaps between streamed chunks after their first; a chunk may carry several tokens) and TPOT p50 (a
    stream's time per output token after its first), the long prompts' TTFT p50/p99 and hand-off p50 (the gap
    between a long prompt's first chunk, from the prefill engine, and its second, from the decode engine: the KV
    transfer's tail plus the decode engine's first step), errors, and the PD engine's fallback and streamed
    transfer counts. PD runs twice: ``pd`` with the KV written layer by layer during the prefill (NIXL) and
    ``pd-after`` with it written after the prefill. On a machine with few cores both engines share the CPUs with
    the client and the front end, so PD's separation of prefill from decode cannot show as it does on separate
    GPUs; the figures say what it costs here.

A benchmark: it prints figures and writes JSON, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from pathlib import Path

from raymoe.bench.serve import _WORDS, RequestResult, stream_request


def add_pd_args(p: argparse.ArgumentParser) -> None:
    """The options of ``raymoe bench pd``."""
    p.add_argument("--model", default=None, help="model folder (default: the demo checkpoint)")
    p.add_argument("--dp", type=int, default=2, help="the colocated engine's DP groups (ep = dp)")
    p.add_argument("--pd-prefill", default="dp=1")
    p.add_argument("--pd-decode", default="dp=2,ep=2")
    p.add_argument("--decoders", type=int, default=16, help="long-running decode streams")
    p.add_argument("--decode-tokens", type=int, default=1024)
    p.add_argument("--long-words", type=int, default=600, help="words of each long prompt")
    p.add_argument("--long-tokens", type=int, default=8, help="answer tokens of each long prompt")
    p.add_argument("--long-rate", type=float, default=4.0, help="long prompts per second (Poisson)")
    p.add_argument("--no-transfer", action="store_true", help="skip part (a)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="bench_results/pd.json")


@contextlib.contextmanager
def _server(a: argparse.Namespace, pd: bool, layerwise: bool = True):
    from raymoe.cli_args import resolve_model
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.deploy.server_config import ServeOptions
    from raymoe.deploy.thread_server import serve_in_thread

    options = {"model": resolve_model(a.model), "max_running_requests": 64, "max_context_len": 4096,
               "max_total_tokens": 65536}
    if pd:
        options |= {"pd_prefill": a.pd_prefill, "pd_decode": a.pd_decode, "pd_kv_layerwise": layerwise}
    else:
        options |= {"dp_size": a.dp, "ep_size": a.dp}
    engine = ServeOptions(**options).engine_client(progress=False)
    try:
        with serve_in_thread(build_openai_app(engine)) as url:
            yield url, engine
    finally:
        engine.shutdown()


async def _load(url: str, a: argparse.Namespace) -> tuple[list[RequestResult], list[RequestResult]]:
    import httpx

    rng = random.Random(a.seed)
    async with httpx.AsyncClient() as probe:
        model = (await probe.get(f"{url}/v1/models", timeout=30)).json()["data"][0]["id"]
    common = {"model": model, "temperature": 0.0, "stream": True, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=a.decoders + 64, max_keepalive_connections=a.decoders + 64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        decoders = [asyncio.create_task(stream_request(client, f"{url}/v1/completions", {
            **common, "prompt": f"stream {i}: def f{i}(x):", "max_tokens": a.decode_tokens}))
            for i in range(a.decoders)]
        await asyncio.sleep(0.3)  # the decode streams are running
        longs = []
        while not all(t.done() for t in decoders):
            prompt = " ".join(rng.choice(_WORDS) for _ in range(a.long_words))
            longs.append(asyncio.create_task(stream_request(client, f"{url}/v1/completions", {
                **common, "prompt": prompt, "max_tokens": a.long_tokens})))
            await asyncio.sleep(rng.expovariate(a.long_rate))
        return await asyncio.gather(*decoders), await asyncio.gather(*longs)


def _q(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))] * 1000.0


def run_pd_bench(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench pd``: (a) and (b), print, write the JSON."""
    from raymoe.cluster.bootstrap import use_loopback_environment

    use_loopback_environment()
    report: dict = {"args": {k: v for k, v in vars(a).items() if k != "func"}}
    if not a.no_transfer:
        from raymoe.bench.kv_transfer import add_kv_transfer_args, run_kv_transfer_bench

        p = argparse.ArgumentParser()
        add_kv_transfer_args(p)
        report["transfer"] = run_kv_transfer_bench(p.parse_args(["--output-json", "/dev/null"]))
    rows = []
    for name, pd, layerwise in (("colocated", False, True), ("pd", True, True), ("pd-after", True, False)):
        print(f"--- {name}", flush=True)
        with _server(a, pd, layerwise) as (url, engine):
            t0 = time.perf_counter()
            decoders, longs = asyncio.run(_load(url, a))
            wall = time.perf_counter() - t0
            failed = getattr(engine, "transfers_failed", None)
            streamed = getattr(engine, "streamed", None)
        ok_d = [r for r in decoders if r.error is None]
        ok_l = [r for r in longs if r.error is None]
        itl = [g for r in ok_d for g in r.itl]
        tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok_d if r.output_tokens > 1]
        rows.append({"engine": name, "wall_s": wall, "decoders": len(decoders), "long_prompts": len(longs),
                     "errors": len(decoders) + len(longs) - len(ok_d) - len(ok_l),
                     "itl_p50_ms": _q(itl, 0.5), "itl_p99_ms": _q(itl, 0.99), "tpot_p50_ms": _q(tpot, 0.5),
                     "long_ttft_p50_ms": _q([r.ttft for r in ok_l], 0.5),
                     "long_ttft_p99_ms": _q([r.ttft for r in ok_l], 0.99),
                     "long_handoff_p50_ms": _q([r.itl[0] for r in ok_l if r.itl], 0.5),
                     "transfers_failed": failed, "transfers_streamed": streamed})
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'engine':<11}{'long prompts':>13}{'err':>5}{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}"
          f"{'long TTFT p50':>15}{'long TTFT p99':>15}{'hand-off p50':>14}")
    for r in rows:
        print(f"{r['engine']:<11}{r['long_prompts']:>13}{r['errors']:>5}{r['itl_p50_ms'] or 0:>7.1f}ms"
              f"{r['itl_p99_ms'] or 0:>7.1f}ms{r['tpot_p50_ms'] or 0:>8.1f}ms{r['long_ttft_p50_ms'] or 0:>13.0f}ms"
              f"{r['long_ttft_p99_ms'] or 0:>13.0f}ms{r['long_handoff_p50_ms'] or 0:>12.0f}ms")
    report["decode_under_arrivals"] = rows
    out = Path(a.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report
