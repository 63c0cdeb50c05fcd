"""What switching radix-cache prefix hits off for hybrid models costs on a shared-prefix workload.

Qwen3.5-MoE keeps a recurrent state per request, so raymoe computes every prompt whole for it
(``raymoe.config.model_rules``). This measures the cost of that choice: one request warms the cache, then
``--requests`` requests that share a ``--shared``-token prefix (plus ``--unique`` tokens of their own) each generate
``--output`` greedy tokens. Printed per engine: seconds of the second wave, prompt tokens computed and served from
the cache (``RequestOutput.cached_tokens``). Engines: the hybrid model (hits off by its rule), and a Qwen3-MoE of the
same sizes with hits on and off, which isolates what hits are worth on this workload.

    python benchmarks/hybrid_prefix_cost.py [--shared 512 --unique 16 --requests 32 --output 8]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint


def _wave(path: str, prompts: list[list[int]], output: int, **options) -> tuple[float, int, int]:
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    with Engine(path, max_context_len=2048, max_total_tokens=65536, **options) as e:
        e.generate(prompt_token_ids=prompts[:1], sampling_params=params)  # warms the cache with the prefix
        t0 = time.perf_counter()
        outs = e.generate(prompt_token_ids=prompts[1:], sampling_params=params)
        seconds = time.perf_counter() - t0
    cached = sum(o.cached_tokens for o in outs)
    return seconds, sum(len(p) for p in prompts[1:]) - cached, cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", type=int, default=512)
    p.add_argument("--unique", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output", type=int, default=8)
    a = p.parse_args()
    rng = random.Random(0)
    shared = [rng.randrange(3, 2000) for _ in range(a.shared)]
    prompts = [shared + [rng.randrange(3, 2000) for _ in range(a.unique)] for _ in range(a.requests + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        hybrid = str(make_checkpoint("qwen3_5_moe", Path(tmp) / "q35", seed=0))
        plain = str(make_checkpoint("qwen3_moe", Path(tmp) / "q3", seed=0))
        rows = [("qwen3_5_moe (hits off: its rule)", _wave(hybrid, prompts, a.output)),
                ("qwen3_moe, radix hits on", _wave(plain, prompts, a.output, enable_radix_cache=True)),
                ("qwen3_moe, radix hits off", _wave(plain, prompts, a.output, enable_radix_cache=False))]
    print(f"{a.requests} requests: {a.shared} shared + {a.unique} own prompt tokens, {a.output} output tokens "
          f"each (after one warming request)")
    print(f"  {'engine':36s} {'seconds':>8s} {'computed':>9s} {'cached':>8s}")
    for name, (s, computed, cached) in rows:
        print(f"  {name:36s} {s:8.2f} {computed:9,d} {cached:8,d}")
    on, off = rows[1][1][0], rows[2][1][0]
    print(f"  prefix hits make the qwen3_moe wave {off / on:.2f}x faster; the hybrid model pays the 'off' cost")


if __name__ == "__main__":
    main()
