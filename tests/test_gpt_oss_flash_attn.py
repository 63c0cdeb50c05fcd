"""gpt-oss's sliding windows and sinks through the flash_attn backend on CPU: the conformance double's
``window_size`` / ``s_aux`` (the fork's wrapper and FA3 entry checks) against a direct computation, then whole
engines through the double (FA3) against ``torch_native`` (eager with chunked prefill, decode graphs with radix
hits), and the refusal of sinks on FA2."""

from __future__ import annotations

import pytest
import torch
from flash_attn_double import FlashAttnDouble
from safetensors.torch import load_file, save_file
from test_flash_attn import paged_case

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint
from raymoe.platform.cuda import flash_attn_provider
from raymoe.platform.cuda.flash_attn_provider import FlashAttnProvider

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "vocab_size": 512, "sliding_window": 6}
PROMPTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1)", "import os\nimport sys\n\n", "x",
           "class Foo(object):\n    def __init__(self, x):\n"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def direct(q, keys, values, q_lens, left, sinks):
    """Bottom-right causal attention with a window of ``left + 1`` keys and sink logits, per sequence, in float32
    (transformers' ``eager_attention_forward`` of gpt-oss: the sink column joins the softmax, then is dropped)."""
    out, start = [], 0
    for ki, vi, ql in zip(keys, values, q_lens, strict=True):
        kl, hq = ki.shape[0], q.shape[1]
        rep = hq // ki.shape[1]
        s = torch.einsum("qhd,khd->hqk", q[start:start + ql].float(), ki.float().repeat_interleave(rep, 1))
        s = s * q.shape[-1] ** -0.5
        diag = torch.arange(ql)[:, None] + (kl - ql)
        key = torch.arange(kl)[None, :]
        s = s.masked_fill((key > diag) | (key < diag - left), float("-inf"))
        logits = torch.cat([s, sinks.float().view(hq, 1, 1).expand(hq, ql, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :-1]
        out.append(torch.einsum("hqk,khd->qhd", p, vi.float().repeat_interleave(rep, 1)))
        start += ql
    return torch.cat(out)


def test_double_window_and_sinks_match_the_direct_form():
    q_lens, k_lens = [5, 1, 16, 3], [5, 40, 37, 19]
    args, keys, values = paged_case(q_lens, k_lens)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16)
    got = FlashAttnDouble()(**args, window_size=(6, 0), s_aux=sinks, fa_version=3)
    want = direct(args["q"], keys, values, q_lens, 6, sinks)
    assert (got.float() - want).abs().max().item() < 2e-2
    plain = FlashAttnDouble()(**args, fa_version=3)
    assert (plain.float() - want).abs().max().item() > 0.1  # the window and sinks change the answer


BAD = {
    "sinks on FA2": (dict(s_aux=torch.zeros(4, dtype=torch.bfloat16), fa_version=2), NotImplementedError, "FA2"),
    "float32 sinks": (dict(s_aux=torch.zeros(4), fa_version=3), RuntimeError, "bf16"),
    "sinks per kv head": (dict(s_aux=torch.zeros(2, dtype=torch.bfloat16), fa_version=3), RuntimeError, "shape"),
    "strided sinks": (dict(s_aux=torch.zeros(8, dtype=torch.bfloat16)[::2], fa_version=3), RuntimeError,
                      "contiguous"),
    "window of three": (dict(window_size=(4, 0, 0)), AssertionError, None),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_double_checks_window_and_sink_arguments(name):
    args, _, _ = paged_case([3, 1], [20, 33])
    extra, error, match = BAD[name]
    with pytest.raises(error, match=match):
        FlashAttnDouble()(**args, **extra)


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory):
    """A tiny gpt-oss folder whose sinks are bfloat16 values (the kernel takes them in bfloat16), and
    ``torch_native``'s greedy tokens."""
    path = make_checkpoint("gpt_oss", tmp_path_factory.mktemp("fa") / "gpt_oss", seed=6, **DIMS)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("sinks")]:
        tensors[name] = tensors[name].to(torch.bfloat16).float()
    save_file(tensors, str(path / "model.safetensors"))
    with Engine(str(path), disable_cuda_graph=True) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    return str(path), ref


def _provider(monkeypatch, fa_version: int) -> FlashAttnDouble:
    double = FlashAttnDouble(allow_float32=True)
    provider = FlashAttnProvider("conformance double", double, ("float32", "bfloat16", "float16"), fa_version,
                                 devices=("cpu", "cuda"))
    monkeypatch.setattr(flash_attn_provider, "find_flash_attn", lambda: provider)
    return double


def test_flash_attn_fa3_matches_torch_native(gpt_oss_model, monkeypatch):
    path, ref = gpt_oss_model
    double = _provider(monkeypatch, 3)
    with Engine(path, attention_backend="flash_attn", disable_cuda_graph=True, chunked_prefill_size=5) as e:
        assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == ref
    assert double.calls > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU double reads host values, which a CUDA graph "
                                                      "capture refuses; the GPU suite covers CUDA graphs")
def test_flash_attn_fa3_graphs_and_radix_hits_match(gpt_oss_model, monkeypatch):
    path, ref = gpt_oss_model
    _provider(monkeypatch, 3)
    with Engine(path, attention_backend="flash_attn", cuda_graph_bs=(1, 2, 4)) as e:
        outs = e.generate(PROMPTS, GREEDY)
        again = e.generate(PROMPTS[:1], GREEDY)
        assert e.driver.num_graph_steps > 0
    assert [o.token_ids for o in outs] == ref and again[0].token_ids == ref[0]
    assert again[0].cached_tokens >= 16


def test_sinks_on_fa2_are_refused(gpt_oss_model, monkeypatch):
    path, _ = gpt_oss_model
    _provider(monkeypatch, 2)
    with pytest.raises(ValueError, match="attention sinks need the FA3 kernels"):
        Engine(path, attention_backend="flash_attn", disable_cuda_graph=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU double reads host values, which a CUDA graph "
                                                      "capture refuses; the GPU suite covers CUDA graphs")
def test_swa_kv_eviction_over_flash_attn_matches(gpt_oss_model, monkeypatch):
    """``swa_kv_eviction`` as on CUDA: the full-attention layers through the kernel on pages of 16 (windows off,
    sinks on), the sliding layers through the rings; chunks of 5 and decode graphs."""
    path, ref = gpt_oss_model
    double = _provider(monkeypatch, 3)
    with Engine(path, attention_backend="flash_attn", cuda_graph_bs=(1, 2, 4), chunked_prefill_size=5,
                swa_kv_eviction=True) as e:
        assert e.config.cache.page_size == 16 and not e.config.cache.enable_radix_cache
        outs = e.generate(PROMPTS, GREEDY)
        assert e.driver.num_graph_steps > 0
    assert [o.token_ids for o in outs] == ref and double.calls > 0
