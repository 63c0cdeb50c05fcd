"""``raymoe bench frontend``: the HTTP front end's CPU per streamed token, in one process, without an engine.

The served step on a small machine is bound by CPU (served dp=2 ep=2 at c=16: 7.30 ms of CPU per step against 4.59 ms
offline, both runs keeping about 1.8 of 2 cores busy): every millisecond the front end spends
per step is taken from the ranks. This benchmark isolates the front end's own Python: the real FastAPI app
(``build_openai_app``: middleware, request preparation and tokenization, ``stream_pieces``, detokenization, stop
strings, metrics, response chunks, the ``EventRelay`` and the SSE response) and the real
``EngineClient.generate``, fed by :class:`SyntheticEngineClient`, which delivers one token to every open stream
per step, as the output reader thread does with the driver's per-step batch. The ASGI app is called directly, so
uvicorn's protocol code, the sockets, the output reader thread and the client are left out (served dp=2 ep=2 at
c=16, the front end's kernel time was about 0.2 s of its 1.3-1.4 s of CPU per 5 s, user + system time from /proc).

Measured: the process's CPU time (``time.process_time``) over ``--requests`` completions of ``--output-len``
tokens each, ``--concurrency`` at a time, per streamed token, in microseconds; one figure per round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from raymoe.actors.driver_service import AddRequest, RequestDelta
from raymoe.client.engine_client import EngineClient


class SyntheticEngineClient(EngineClient):
    """An ``EngineClient`` without a driver actor or Ray: its engine is a task on the same event loop that, every
    ``step_s`` seconds, delivers one random token to each request the front end has sent (``finish_reason="length"``
    at ``output_len``). Aborts forget the request.

    Args:
        model: Hugging Face model folder (tokenizer and config; no weights are loaded).
        output_len: tokens per request. step_s: pause between steps, seconds.
    """

    def __init__(self, model: str, output_len: int, step_s: float = 0.0005):
        from raymoe.config import EngineConfig, ModelConfig
        from raymoe.tokenizer import load_tokenizer

        self.config = EngineConfig(model=model)
        self.model_config = ModelConfig.from_hf(model)
        self.model_name = Path(model).name
        self.tokenizer = load_tokenizer(model)
        self.output_len = output_len
        self.step_s = step_s
        self._streams = {}
        self.frontend_id = ""
        self._dead = None
        self._closing = False
        self._progress: dict[str, tuple[int, int]] = {}  # request id -> (prompt tokens, tokens delivered)

    def _send(self, adds: list[AddRequest], aborts: list[str]) -> None:
        for add in adds:
            self._progress[add.request_id] = (len(add.prompt_token_ids), 0)
        for rid in aborts:
            self._progress.pop(rid, None)

    async def run_steps(self) -> None:
        """Deliver tokens until cancelled."""
        rng = random.Random(0)
        vocab = self.model_config.vocab_size
        while True:
            await asyncio.sleep(self.step_s)
            for rid, (prompt, n) in list(self._progress.items()):
                route = self._streams.get(rid)
                if route is None:
                    continue
                n += 1
                done = n >= self.output_len
                self._progress[rid] = (prompt, n)
                if done:
                    del self._progress[rid]
                route[1].put_nowait(RequestDelta(rid, [rng.randrange(vocab)], [None], finished=done,
                                                 finish_reason="length" if done else None, prompt_tokens=prompt,
                                                 completion_tokens=n))


async def _stream_one(app, body: bytes) -> list[bytes]:
    """POST ``body`` to ``/v1/completions`` through the ASGI app; returns the response body messages."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    chunks: list[bytes] = []
    sent, done = False, asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return chunks


async def measure(model: str, concurrency: int, requests: int, output_len: int, rounds: int,
                  warmup: int = 64) -> dict:
    """Front-end CPU per streamed token (µs), one figure per round, after ``warmup`` requests.

    Raises:
        RuntimeError: a stream did not end in ``data: [DONE]`` with ``output_len`` data events before it.
    """
    from raymoe.deploy.openai_api import build_openai_app

    engine = SyntheticEngineClient(model, output_len)
    app = build_openai_app(engine, max_in_flight=concurrency)
    stepper = asyncio.create_task(engine.run_steps())
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        body = json.dumps({"model": engine.model_name, "prompt": f"request {i}: " + "hello world " * 10,
                           "max_tokens": output_len, "stream": True, "ignore_eos": True}).encode()
        async with gate:
            chunks = await _stream_one(app, body)
        events = b"".join(chunks).split(b"\n\n")
        data = [e for e in events if e.startswith(b"data: ")]
        if not data or data[-1] != b"data: [DONE]" or len(data) - 1 > output_len:
            raise RuntimeError(f"request {i}: the stream did not end in [DONE] after at most {output_len} "
                               f"chunks: {b''.join(chunks)[-200:]!r}")

    try:
        await asyncio.gather(*(one(i) for i in range(warmup)))
        us_per_token = []
        for _ in range(rounds):
            t0 = time.process_time()
            await asyncio.gather(*(one(i) for i in range(requests)))
            us_per_token.append(1e6 * (time.process_time() - t0) / (requests * output_len))
    finally:
        stepper.cancel()
    return {"concurrency": concurrency, "requests": requests, "output_len": output_len,
            "us_per_token": us_per_token, "us_per_token_median": statistics.median(us_per_token)}


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """Options of ``raymoe bench frontend``."""
    p.add_argument("--model", required=True, help="Hugging Face model folder (tokenizer and config only)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=1024, help="requests per round")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output-json", default="bench_results/frontend.json")


def run_frontend(a: argparse.Namespace) -> dict:
    """Entry point of ``raymoe bench frontend``: prints the figures and writes JSON to ``a.output_json``."""
    result = asyncio.run(measure(a.model, a.concurrency, a.requests, a.output_len, a.rounds))
    rounds = ", ".join(f"{v:.1f}" for v in result["us_per_token"])
    print(f"front-end CPU per streamed token, {a.concurrency} streams x {a.output_len} tokens: "
          f"median {result['us_per_token_median']:.1f} us (rounds: {rounds})")
    out = Path(a.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result
