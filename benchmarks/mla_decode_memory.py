"""Peak extra memory of one MLA decode step on the torch path, against the KV bytes the step reads.

    PYTHONPATH=. python benchmarks/mla_decode_memory.py [--slots 32768] [--bs 64] [--heads 16] [--dtype bfloat16]
        [--long 8192] [--seed 0] [--one-gather]

One attention layer of DeepSeek-V3's MLA shape (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64; ``--heads`` local
query heads, 16 = 128 heads over TP 8) over a latent cache of ``--slots`` slots and a request table as wide as the
cache (max context = ``--slots`` tokens). ``--bs`` requests hold random lengths of 32..600 tokens, one of them
``--long`` tokens, within the cache. The step runs as an eager decode (rows read over the longest sequence) and as
a decode graph at the table's full width (``kv_width`` = ``--slots``, the widest graph a runner captures), through
``TorchNativeMLABackend`` with its default chunk; ``--one-gather`` adds the eager step with one gather over the
whole width (the behaviour before the chunked decode, for comparison).

"Peak extra" is the largest sum of CPU allocations alive during the step minus those before it (torch profiler
memory events: every tensor the step allocates, kernel scratch included); "KV read" is the bytes of the rows the
requests actually use (sum of seq_lens x row bytes). Prints one line per mode and exits 1 when a chunked mode's
ratio is 2 or more.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from raymoe.attention.mla_torch_native import TorchNativeMLABackend
from raymoe.kvcache.mla_pool import MLATokenToKVPool
from raymoe.kvcache.pools import ReqToTokenPool
from raymoe.step.forward_mode import ForwardMode

LORA, ROPE = 512, 64


def peak_extra_bytes(fn) -> tuple[int, float]:
    """Run ``fn`` once under the profiler: (peak bytes allocated above the start, seconds)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        fn()
        secs = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0, *totals]), secs


def build(args):
    """Cache, table, backend inputs and the batch of one decode step (module docstring)."""
    g = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    lens = torch.randint(32, 601, (args.bs,), generator=g)
    lens[0] = args.long
    if int(lens.sum()) > args.slots:
        raise SystemExit(f"{int(lens.sum())} tokens do not fit {args.slots} slots; lower --long or --bs")
    pool = MLATokenToKVPool(args.slots, 1, LORA, ROPE, dtype)
    pool.kv_buffer[0].normal_(generator=g)
    table = ReqToTokenPool(args.bs + 1, args.slots)
    perm = torch.randperm(args.slots, generator=g) + 1
    used = 0
    for r, n in enumerate(lens.tolist()):
        table.req_to_token[r, :n] = perm[used:used + n]
        used += n
    q = torch.randn(args.bs, args.heads, LORA + ROPE, generator=g).to(dtype)
    new = torch.randn(args.bs, LORA + ROPE, generator=g).to(dtype)
    seq_lens = lens.to(torch.int64)
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=args.bs, req_pool_indices=torch.arange(args.bs),
                         seq_lens=seq_lens, seq_lens_cpu=seq_lens.tolist(),
                         out_cache_loc=table.req_to_token[torch.arange(args.bs), seq_lens - 1].clone())
    return pool, table, q, new, fb


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=32768)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--long", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--one-gather", action="store_true")
    args = p.parse_args(argv)
    pool, table, q, new, fb = build(args)
    row_bytes = (LORA + ROPE) * pool.kv_buffer[0].element_size()
    kv_read = sum(fb.seq_lens_cpu) * row_bytes
    print(f"MLA decode: bs={args.bs} heads={args.heads} {args.dtype} cache {args.slots} slots, table width "
          f"{args.slots}; seq_lens sum {sum(fb.seq_lens_cpu)} (longest {max(fb.seq_lens_cpu)}); KV read "
          f"{kv_read / 2**20:.1f} MiB")
    modes = [("eager", None, None), ("graph@full-width", args.slots, None)]
    if args.one_gather:
        modes.append(("eager one-gather (before)", None, 1 << 30))
    failed = False
    for name, width, chunk in modes:
        kwargs = {} if chunk is None else {"kv_chunk": chunk}
        be = TorchNativeMLABackend(table, pool, num_heads=args.heads, softmax_scale=0.1, **kwargs)
        if width is None:
            be.init_forward_metadata(fb)
        else:
            be.init_cuda_graph_state(args.bs, width)
            be.init_forward_metadata_replay_cuda_graph(args.bs, fb.req_pool_indices, fb.seq_lens,
                                                       fb.seq_lens_cpu, fb.forward_mode, kv_width=width)
        peak, secs = peak_extra_bytes(lambda be=be: be.forward(q, new, None, 0, fb))
        ratio = peak / kv_read
        print(f"  {name:28s} width {be.kv_indices.shape[1]:6d} chunk {be.kv_chunk:>10d}: peak extra "
              f"{peak / 2**20:8.1f} MiB = {ratio:5.2f}x KV read, {secs * 1e3:8.1f} ms")
        failed |= chunk is None and ratio >= 2
    print("FAIL: peak extra >= 2x KV read" if failed else "ok: chunked modes below 2x KV read")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
