"""The flash_attn backend on CPU: the conformance double of vLLM's kernel against SDPA, then whole engines through
the double against the torch_native backend (eager, decode graphs, chunked prefill, radix-cache hits, retraction),
and the config-time error when the package is missing."""

from __future__ import annotations

import importlib.util
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F
from flash_attn_double import FlashAttnDouble

from raymoe import Engine, SamplingParams
from raymoe.config import CacheConfig, EngineConfig
from raymoe.errors import BackendUnavailableError, InvalidRequestError
from raymoe.platform.cuda import flash_attn_provider
from raymoe.platform.cuda.flash_attn_provider import FlashAttnProvider
from raymoe.runner.model_runner import RunnerConfig

# ------------------------------------------------------------------------------------------------ the double


def paged_case(q_lens, k_lens, page=16, hq=4, hkv=2, d=32, dtype=torch.bfloat16, seed=0):
    """Per-sequence contiguous K/V (the truth) scattered into shuffled pages, and the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-kl // page) for kl in k_lens]
    num_blocks = sum(n_pages) + 3
    order = torch.randperm(num_blocks, generator=g)
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(k_lens), max(n_pages), dtype=torch.int32)
    keys, values, used = [], [], 0
    for i, (kl, n) in enumerate(zip(k_lens, n_pages, strict=True)):
        table[i, :n] = order[used:used + n]
        used += n
        ki = torch.randn(kl, hkv, d, generator=g).to(dtype)
        vi = torch.randn(kl, hkv, d, generator=g).to(dtype)
        for pos in range(kl):
            k_cache[table[i, pos // page], pos % page] = ki[pos]
            v_cache[table[i, pos // page], pos % page] = vi[pos]
        keys.append(ki)
        values.append(vi)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    args = dict(q=q, k=k_cache, v=v_cache, max_seqlen_q=max(q_lens),
                cu_seqlens_q=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32), max_seqlen_k=max(k_lens),
                seqused_k=torch.tensor(k_lens, dtype=torch.int32), causal=True, block_table=table)
    return args, keys, values


def sdpa_reference(q, keys, values, q_lens):
    """Bottom-right causal SDPA per sequence in float32 over the contiguous K/V."""
    out, start = [], 0
    for ki, vi, ql in zip(keys, values, q_lens, strict=True):
        kl = ki.shape[0]
        qi = q[start:start + ql].float().transpose(0, 1)[None]                       # [1, Hq, ql, D]
        mask = torch.arange(kl)[None, :] <= torch.arange(ql)[:, None] + (kl - ql)
        o = F.scaled_dot_product_attention(qi, ki.float().transpose(0, 1)[None], vi.float().transpose(0, 1)[None],
                                           attn_mask=mask, enable_gqa=True)
        out.append(o[0].transpose(0, 1))
        start += ql
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_double_matches_sdpa_on_shuffled_pages(dtype):
    q_lens, k_lens = [5, 1, 16, 3, 1], [5, 40, 37, 19, 16]   # prefill, decodes, extends over cached prefixes
    args, keys, values = paged_case(q_lens, k_lens, dtype=dtype)
    out = torch.full_like(args["q"], float("nan"))
    double = FlashAttnDouble()
    got = double(**args, out=out, fa_version=2)
    assert got is out and double.calls == 1 and got.dtype == dtype and got.shape == args["q"].shape
    want = sdpa_reference(args["q"], keys, values, q_lens)
    assert (got.float() - want).abs().max().item() < 2e-2


BAD_ARGS = {
    "cu_seqlens_q int64": (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), RuntimeError, "int32"),
    "seqused_k int64": (lambda a: a.update(seqused_k=a["seqused_k"].long()), RuntimeError, "int32"),
    "block_table int64": (lambda a: a.update(block_table=a["block_table"].long()), RuntimeError, "int32"),
    "block_table strided": (lambda a: a.update(block_table=a["block_table"].t().contiguous().t()), RuntimeError,
                            "contiguous last dimension"),
    "float32": (lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()), RuntimeError,
                "fp16 and bf16"),
    "kv dtype": (lambda a: a.update(k=a["k"].half()), RuntimeError, "same dtype"),
    "block size 8": (lambda a: a.update(k=a["k"].reshape(-1, 8, 2, 32), v=a["v"].reshape(-1, 8, 2, 32)),
                     RuntimeError, "divisible by 16"),
    "heads 3 over 2": (lambda a: a.update(q=a["q"][:, :3]), RuntimeError, "must divide"),
    "no seqused_k": (lambda a: a.update(seqused_k=None), AssertionError, "seqused_k must be provided"),
    "both k lengths": (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_q"]), AssertionError, "cannot be provided"),
    "fa_version 4": (lambda a: a.update(fa_version=4), ValueError, "Unsupported FA version"),
    "short table": (lambda a: a.update(block_table=a["block_table"][:, :1].contiguous()), RuntimeError,
                    "too narrow"),
}


@pytest.mark.parametrize("name", sorted(BAD_ARGS))
def test_double_makes_the_kernels_argument_checks(name):
    args, _, _ = paged_case([3, 1], [20, 33])
    mutate, error, match = BAD_ARGS[name]
    mutate(args)
    with pytest.raises(error, match=match):
        FlashAttnDouble()(**args)


# ---------------------------------------------------------------------------------------------- the engine
PROMPTS = ["def fib(n):", "import os\nimport sys\n\n", "class Foo(object):\n    def __init__(self, x):\n",
           "x", "The quick brown fox jumps over the lazy dog. " * 3, "for i in range(10):\n    print(i)\n"]
SHARED = ("def helper(a, b, c):\n    \"\"\"Combine three values into a tuple and return it.\"\"\"\n"
          "    return (a, b, c)\n")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture
def fa_double(monkeypatch):
    """The double as the flash_attn provider (float32 allowed, so parity runs in fp32 like the oracle tests)."""
    double = FlashAttnDouble(allow_float32=True)
    provider = FlashAttnProvider("conformance double", double, ("float32", "bfloat16", "float16"), fa_version=2,
                                 devices=("cpu", "cuda"))
    monkeypatch.setattr(flash_attn_provider, "find_flash_attn", lambda: provider)
    return double


@pytest.fixture(scope="module")
def reference(tiny_model):
    prompts = PROMPTS + [SHARED + p for p in PROMPTS[:3]]
    with Engine(tiny_model, disable_cuda_graph=True) as e:
        return {p: o.token_ids for p, o in zip(prompts, e.generate(prompts, GREEDY), strict=True)}


def run(engine, prompts, reference):
    outs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference[p], f"prompt {p!r}"
    engine.driver.schedulers[0].check_memory_invariants()
    return outs


def test_flash_attn_eager_chunked_prefill_matches_torch_native(tiny_model, reference, fa_double):
    with Engine(tiny_model, attention_backend="flash_attn", disable_cuda_graph=True, chunked_prefill_size=5) as e:
        assert e.config.cache.page_size == 16
        run(e, PROMPTS, reference)
    assert fa_double.calls > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU double reads host values, which a CUDA graph "
                                                      "capture refuses; the GPU suite covers CUDA graphs")
def test_flash_attn_decode_graphs_and_radix_hits_match_torch_native(tiny_model, reference, fa_double):
    prompts = [SHARED + p for p in PROMPTS[:3]]
    with Engine(tiny_model, attention_backend="flash_attn", cuda_graph_bs=(1, 2, 4)) as e:
        run(e, prompts[:1], reference)
        rest = run(e, prompts[1:], reference)
        run(e, PROMPTS, reference)
        assert e.driver.num_graph_steps > 0
    assert all(o.cached_tokens >= 16 and o.cached_tokens % 16 == 0 for o in rest)


def test_flash_attn_small_pool_retracts_and_matches(tiny_model, reference, fa_double):
    with Engine(tiny_model, attention_backend="flash_attn", max_total_tokens=96, chunked_prefill_size=32,
                disable_cuda_graph=True) as e:
        run(e, PROMPTS, reference)
        assert e.driver.schedulers[0].num_retractions > 0


def test_torch_native_on_paged_kv_matches(tiny_model, reference):
    with Engine(tiny_model, page_size=16, chunked_prefill_size=7, cuda_graph_bs=(1, 2, 4)) as e:
        run(e, PROMPTS[:1] + [SHARED + p for p in PROMPTS[:3]], reference)


# ---------------------------------------------------------------------------------------- config checks
@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_flash_attn_without_vllm_fails_at_config_time(tiny_model):
    with pytest.raises(BackendUnavailableError, match="vllm") as err:
        EngineConfig(model=tiny_model, attention_backend="flash_attn")
    assert err.value.field == "attention_backend" and isinstance(err.value, ImportError)
    with pytest.raises(BackendUnavailableError, match="pip install vllm"):
        RunnerConfig(tiny_model, "bfloat16", num_kv_slots=255, max_req_rows=2, max_context_len=64, page_size=16,
                     attention_backend="flash_attn")
    with pytest.raises(BackendUnavailableError, match="vllm"):
        Engine(tiny_model, attention_backend="flash_attn")


def test_flash_attn_options_are_checked_at_config_time(tiny_model, fa_double, monkeypatch):
    with pytest.raises(InvalidRequestError, match="multiple of 16") as err:
        EngineConfig(model=tiny_model, attention_backend="flash_attn", cache=CacheConfig(page_size=8))
    assert err.value.field == "page_size"
    strict = FlashAttnProvider("strict double", FlashAttnDouble(), ("float16", "bfloat16"), fa_version=2)
    monkeypatch.setattr(flash_attn_provider, "find_flash_attn", lambda: strict)
    with pytest.raises(InvalidRequestError, match="float32") as err:
        EngineConfig(model=tiny_model, attention_backend="flash_attn", dtype="float32")
    assert err.value.field == "dtype"
    assert EngineConfig(model=tiny_model, attention_backend="flash_attn", dtype="bfloat16").cache.page_size == 16
    assert EngineConfig(model=tiny_model).cache.page_size == 1
