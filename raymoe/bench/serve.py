"""``raymoe bench serve``: load an OpenAI-compatible server with streaming requests and report latency figures.

Workloads: random prompts (``--input-len`` words each, ``--output-len`` tokens with ``ignore_eos`` so every
request generates the same number of tokens), or an MT-Bench style ``question.jsonl`` (``--dataset-path``): each
question is a two-turn chat, where turn 2 resends turn 1 and its answer, a natural prefix-cache workload.
``--chat`` sends random prompts as one-turn chats; ``--json-schema builtin|PATH`` adds a ``response_format``
json_schema to every chat request (grammar-constrained decoding; ``builtin``: a nested record with strings, an
enum, numbers and arrays) and reports how many finished answers parse as JSON; run once with ``--chat`` and once
with ``--json-schema`` to measure what constraints cost.
Requests start at ``--request-rate`` per second (Poisson arrivals; ``inf``: all at once) with at most
``--concurrency`` conversations in flight. Reported: request and token throughput, time to first token (TTFT),
inter-token latency (ITL: gaps between streamed chunks), time per output token (TPOT), end-to-end latency
(p50/p90/p99, milliseconds) and errors; printed and written as JSON. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

_WORDS = ("def return import class self value list dict for while if else try except with yield lambda async "
          "await print range len open file path data result index count total item key error config model "
          "token cache batch request server engine expert layer weight tensor").split()


@dataclass
class RequestResult:
    """One streamed request: timings in seconds; token counts from the final usage chunk (``cached_tokens``: prompt
    tokens served from the prefix cache); ``error`` is None on success."""

    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


def random_prompts(num: int, input_len: int, seed: int) -> list[str]:
    """``num`` prompts of ``input_len`` random words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num)]


def load_conversations(path: str, num: int) -> list[list[str]]:
    """The ``turns`` of ``num`` questions of an MT-Bench style jsonl file (cycled when it has fewer)."""
    rows = [json.loads(line)["turns"] for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no questions")
    return [rows[i % len(rows)] for i in range(num)]


async def stream_request(client, url: str, body: dict) -> RequestResult:
    """Send one streaming request and time its chunks."""
    res = RequestResult()
    start = last = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in chunk.get("choices", []):
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if not res.text:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.text += text
    except Exception as e:  # noqa: BLE001 - a failed request is a figure of the benchmark
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    if not done:
        res.error = "stream ended without [DONE]"
    return res


def _percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return (s[lo] + (s[hi] - s[lo]) * (k - lo)) * scale

    return {"mean": sum(s) / len(s) * scale, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Throughput and latency figures of a run (latencies in milliseconds)."""
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "duration_s": duration, "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration if duration else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "ttft_ms": _percentiles([r.ttft for r in ok]), "itl_ms": _percentiles([g for r in ok for g in r.itl]),
        "tpot_ms": _percentiles(tpot), "e2e_latency_ms": _percentiles([r.latency for r in ok]),
    }


BUILTIN_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"], "additionalProperties": False,
}
"""``--json-schema builtin``: a realistic extraction record (nested object, enum, arrays, numbers, free strings)."""


def json_schema_format(spec: str | None) -> dict | None:
    """The ``response_format`` of ``--json-schema`` (None: none): ``builtin`` or a path to a schema file."""
    if spec is None or spec == "none":
        return None
    schema = BUILTIN_SCHEMA if spec == "builtin" else json.loads(Path(spec).read_text())
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}


def _json_valid(results: list[RequestResult]) -> int:
    n = 0
    for r in results:
        if r.error is None and r.finish_reason == "stop":
            try:
                json.loads(r.text)
                n += 1
            except ValueError:
                pass
    return n


async def _first_model(client, base_url: str) -> str:
    r = await client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_benchmark(a: argparse.Namespace) -> dict:
    """Run the workload of ``a`` against ``a.base_url``; returns the summary (with the arguments)."""
    import httpx
    from tqdm import tqdm

    base = a.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=a.concurrency + 4, max_keepalive_connections=a.concurrency + 4)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(a.timeout), limits=limits) as client:
        model = a.model or await _first_model(client, base)
        fmt = json_schema_format(a.json_schema)
        chat = a.dataset_path is not None or a.chat or fmt is not None
        ignore_eos = (a.dataset_path is None) if a.ignore_eos is None else a.ignore_eos
        common = {"model": model, "max_tokens": a.output_len, "temperature": a.temperature, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
        if fmt is not None:
            common["response_format"] = fmt
        work = (load_conversations(a.dataset_path, a.num_prompts) if a.dataset_path is not None
                else [[p] for p in random_prompts(a.num_prompts, a.input_len, a.seed)])
        sem = asyncio.Semaphore(a.concurrency)
        bar = tqdm(total=sum(len(w) for w in work), desc="bench serve", unit="req")
        results: list[RequestResult] = []

        async def conversation(turns: list[str]) -> None:
            async with sem:
                history: list[dict] = []
                for turn in turns:
                    if chat:
                        history.append({"role": "user", "content": turn})
                        res = await stream_request(client, f"{base}/v1/chat/completions",
                                                   {**common, "messages": list(history)})
                        history.append({"role": "assistant", "content": res.text})
                    else:
                        res = await stream_request(client, f"{base}/v1/completions", {**common, "prompt": turn})
                    results.append(res)
                    bar.update()

        rng = random.Random(a.seed)
        tasks = []
        start = time.perf_counter()
        for turns in work:
            tasks.append(asyncio.create_task(conversation(turns)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(a.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    summary = summarize(results, duration)
    if fmt is not None:
        summary["json_schema"] = a.json_schema
        summary["json_valid"] = _json_valid(results)
        summary["finished_stop"] = sum(r.error is None and r.finish_reason == "stop" for r in results)
    workload = "mt_bench_two_turn" if a.dataset_path is not None else "random_chat" if chat else "random"
    return {"base_url": base, "model": model, "workload": workload,
            "concurrency": a.concurrency, "num_prompts": a.num_prompts,
            "request_rate": None if a.request_rate == float("inf") else a.request_rate,
            "output_len": a.output_len, "input_len_words": None if chat else a.input_len, **summary}


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``raymoe bench serve``."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=16, help="conversations in flight at once")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts (or dataset questions) to send")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="new prompts per second (Poisson)")
    p.add_argument("--dataset-path", default=None, help="MT-Bench style question.jsonl (two-turn chats)")
    p.add_argument("--input-len", type=int, default=32, help="words per random prompt")
    p.add_argument("--output-len", type=int, default=64, help="max tokens per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly --output-len tokens (default: on for random prompts)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="send random prompts as one-turn chats")
    p.add_argument("--json-schema", default=None, metavar="builtin|PATH",
                   help="constrain every chat answer to a JSON schema (response_format json_schema)")
    p.add_argument("--output-json", default="bench_results/serve.json")


def run_serve_bench(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench serve``: run, print the figures, write the JSON."""
    summary = asyncio.run(run_benchmark(a))
    s = summary
    print(f"requests {s['completed']}/{s['requests']} ok, {s['errors']} errors in {s['duration_s']:.1f} s")
    print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s")
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        q = s[name]
        if q["p50"] is not None:
            print(f"{name:>15}: mean {q['mean']:.1f}  p50 {q['p50']:.1f}  p90 {q['p90']:.1f}  p99 {q['p99']:.1f}")
    if "json_valid" in s:
        print(f"json_schema {s['json_schema']}: {s['finished_stop']} answers completed their document, "
              f"{s['json_valid']} of them parse as JSON")
    if s["error_samples"]:
        print("errors:", *s["error_samples"], sep="\n  ")
    if a.output_json:
        out = Path(a.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out}")
    return summary
