"""One PD request at a time: TTFT and the hand-off (the gap between the first token, from the prefill engine, and
the second, from the decode engine) with the KV written layer by layer during the prefill and after it.

    python benchmarks/pd_handoff.py [--model DIR] [--prompt-tokens 1500] [--requests 12]

Runs the prefill engine (dp=1) and the decode engine (dp=2 ep=2) of ``raymoe.client.pd_client`` twice on the local
Ray cluster, once per mode, and prints the medians (the first two requests of each mode are warm-up). A benchmark:
it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from raymoe.cluster.bootstrap import use_loopback_environment


def run(model: str, layerwise: bool, prompt_tokens: int, requests: int) -> dict:
    from raymoe.client.pd_client import PDEngineClient
    from raymoe.client.pd_config import pd_engine_configs
    from raymoe.scheduler.sampling_params import SamplingParams

    options = {"max_running_requests": 64, "max_context_len": 4096, "max_total_tokens": 65536}
    pd = PDEngineClient(*pd_engine_configs(model, options, "dp=1", "dp=2,ep=2"), layerwise=layerwise)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> list[float]:
        prompt = [5 + (j * 7 + i) % 400 for j in range(prompt_tokens)]  # each request its own prompt (no hits)
        t0, times = time.perf_counter(), []
        async for _ in pd.generate(f"r{i}", prompt, params):
            times.append(time.perf_counter() - t0)
        return times

    async def main() -> list[list[float]]:
        return [await one(i) for i in range(requests)]

    try:
        runs = asyncio.run(main())[2:]
        return {"layerwise": layerwise, "streamed": pd.streamed, "failed": pd.transfers_failed,
                "ttft_ms": statistics.median(r[0] for r in runs) * 1e3,
                "handoff_ms": statistics.median(r[1] - r[0] for r in runs) * 1e3}
    finally:
        pd.shutdown()


def main() -> None:
    use_loopback_environment()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo checkpoint)")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--requests", type=int, default=12)
    a = p.parse_args()
    from raymoe.cli_args import resolve_model

    model = resolve_model(a.model)
    for layerwise in (True, False):
        r = run(model, layerwise, a.prompt_tokens, a.requests)
        print(f"layerwise={r['layerwise']!s:<5} TTFT p50 {r['ttft_ms']:6.1f} ms  hand-off p50 {r['handoff_ms']:5.1f} ms"
              f"  streamed {r['streamed']}  fallbacks {r['failed']}", flush=True)


if __name__ == "__main__":
    main()
