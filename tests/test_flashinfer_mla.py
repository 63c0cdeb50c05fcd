"""The flashinfer_mla backend on CPU: the conformance double of FlashInfer's ``BatchMLAPagedAttentionWrapper``
against the torch-native MLA backend (decode, causal extend over cached prefixes, pages of 1 and 4 tokens, decode
graphs' fixed buffers), its argument checks, then whole DeepSeek-V3 engines through the double against
torch_native (eager with chunked prefill and radix hits, decode graphs), and the config-time errors."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from flashinfer_mla_double import BatchMLAPagedAttentionWrapperDouble
from hf_models import build

from raymoe import Engine, SamplingParams
from raymoe.attention.mla_torch_native import TorchNativeMLABackend
from raymoe.attention.tbo import TboAttnBackend
from raymoe.config import EngineConfig
from raymoe.errors import BackendUnavailableError, InvalidRequestError
from raymoe.kvcache.mla_pool import MLATokenToKVPool
from raymoe.kvcache.pools import ReqToTokenPool
from raymoe.platform.cuda import flashinfer_mla_provider
from raymoe.platform.cuda.flashinfer_mla import FlashInferMLABackend
from raymoe.platform.cuda.flashinfer_mla_provider import FlashInferMLAProvider
from raymoe.platform.selector import reference_platform
from raymoe.step.forward_mode import ForwardMode

LORA, ROPE, NOPE, VDIM, HEADS = 512, 64, 16, 16, 4
SCALE = (NOPE + ROPE) ** -0.5


def _double(allow_float32: bool = False) -> type:
    """A fresh subclass of the double (its own run count)."""
    return type("Wrapper", (BatchMLAPagedAttentionWrapperDouble,), {"allow_float32": allow_float32, "runs": 0})


def _provider(cls: type, dtypes=("float16", "bfloat16"), devices=("cpu", "cuda")) -> FlashInferMLAProvider:
    """The double as a provider; it computes on CPU too unless ``devices`` says otherwise (the real kernels)."""
    return FlashInferMLAProvider("conformance double", cls, dtypes, workspace_bytes=1024, devices=devices)


# ------------------------------------------------------------------------------- backend against torch-native
def _case(seq_lens, ext_lens, page, dtype, seed=0, device="cpu"):
    """A latent cache of shuffled pages holding each request's cached rows, the table, absorbed weights and the
    step's inputs: full queries, their absorbed form and the new rows (on ``device``; also used by the GPU suite)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-s // page) for s in seq_lens) + 3
    pool = MLATokenToKVPool(n_pages * page - 1, 1, LORA, ROPE, dtype)
    pool.kv_buffer[0].copy_(torch.randn(n_pages * page, LORA + ROPE, generator=g))
    width = max(seq_lens) + page
    table = ReqToTokenPool(len(seq_lens) + 1, width, page_size=page)
    order = torch.randperm(n_pages - 1, generator=g) + 1
    used = 0
    for r, sl in enumerate(seq_lens):
        for j in range(-(-sl // page)):
            first = int(order[used]) * page
            table.req_to_token[r, j * page:(j + 1) * page] = torch.arange(first, first + page)
            used += 1
    w_uk = torch.randn(HEADS, NOPE, LORA, generator=g) / LORA ** 0.5
    w_uv = torch.randn(HEADS, VDIM, LORA, generator=g) / LORA ** 0.5
    t = sum(ext_lens)
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=g)
    rows = torch.randn(t, LORA + ROPE, generator=g)
    absorbed = torch.cat((torch.einsum("thd,hdl->thl", q[..., :NOPE], w_uk), q[..., NOPE:]), dim=-1)
    loc = torch.cat([table.req_to_token[r, sl - e:sl] for r, (sl, e) in enumerate(zip(seq_lens, ext_lens,
                                                                                       strict=True))])
    if device != "cpu":
        pool.kv_buffer = [b.to(device) for b in pool.kv_buffer]
        table.req_to_token = table.req_to_token.to(device)
    return (pool, table, w_uk.to(device), w_uv.to(device), q.to(device, dtype), absorbed.to(device, dtype),
            rows.to(device, dtype), loc.to(device))


def _batch(seq_lens, ext_lens, loc, mode):
    """The fields of a ForwardBatch the MLA backends read (on ``loc``'s device)."""
    dev = loc.device
    return SimpleNamespace(forward_mode=mode, batch_size=len(seq_lens),
                           req_pool_indices=torch.arange(len(seq_lens), device=dev),
                           req_pool_indices_cpu=list(range(len(seq_lens))), seq_lens=torch.tensor(seq_lens, device=dev),
                           seq_lens_cpu=list(seq_lens), extend_lens_cpu=list(ext_lens),
                           prefix_lens_cpu=[s - e for s, e in zip(seq_lens, ext_lens, strict=True)],
                           out_cache_loc=loc)


@pytest.mark.parametrize("page", [1, 4])
def test_double_equals_torch_native_mla_in_decode_and_extend(page):
    """bf16, shuffled pages: decode (absorbed on both sides) and a causal extend over cached prefixes (torch-native
    expands keys/values; flashinfer attends with absorbed queries and the layer applies W_UV) agree."""
    seq_lens, ext_lens = [9, 1, 23, 6], [3, 1, 23, 1]
    cls = _double()
    for mode, exts in ((ForwardMode.DECODE, [1] * 4), (ForwardMode.EXTEND, ext_lens)):
        pool, table, w_uk, w_uv, q, absorbed, rows, loc = _case(seq_lens, exts, page, torch.bfloat16)
        fb = _batch(seq_lens, exts, loc, mode)
        fi = FlashInferMLABackend(table, pool, HEADS, SCALE, provider=_provider(cls))
        fi.init_forward_metadata(fb)
        got = torch.einsum("thl,hvl->thv", fi.forward(absorbed, rows, None, 0, fb).float(), w_uv)
        tn = TorchNativeMLABackend(table, pool, HEADS, SCALE)
        tn.init_forward_metadata(fb)
        if mode == ForwardMode.DECODE:
            want = torch.einsum("thl,hvl->thv", tn.forward(absorbed, rows, None, 0, fb).float(), w_uv)
        else:
            w = torch.cat((w_uk, w_uv), dim=1).reshape(-1, LORA).to(torch.bfloat16)

            def expand(r, w=w):
                kv = torch.nn.functional.linear(r[:, :LORA], w).view(r.shape[0], HEADS, -1)
                k_pe = r[:, None, LORA:].expand(r.shape[0], HEADS, ROPE)
                return torch.cat((kv[..., :NOPE], k_pe), dim=-1), kv[..., NOPE:]

            want = tn.forward(q, rows, expand, 0, fb).float()
        assert got.shape == want.shape == (sum(exts), HEADS, VDIM)
        assert (got - want).abs().max().item() < 3e-2, mode
    assert cls.runs == 2


def test_graph_wrappers_read_fixed_buffers_planned_before_each_replay():
    """Decode graphs: one use_cuda_graph wrapper per bucket over slices of fixed buffers; a replan with new lengths
    (outside the graph) changes what the same wrapper computes; padding rows (seq_len 1) are harmless."""
    seq_lens = [9, 23, 1]
    cls = _double()
    pool, table, _, w_uv, _, absorbed, rows, loc = _case(seq_lens, [1, 1, 1], 4, torch.bfloat16)
    fi = FlashInferMLABackend(table, pool, HEADS, SCALE, provider=_provider(cls))
    fi.init_cuda_graph_state(max_bs=4, max_kv_len=32)
    fb = _batch(seq_lens, [1, 1, 1], loc, ForwardMode.DECODE)
    fi.init_forward_metadata_capture_cuda_graph(3, fb.req_pool_indices, fb.seq_lens, ForwardMode.DECODE)
    wrapper = fi.active
    assert wrapper is fi.graph_wrappers[3] and wrapper._use_cuda_graph
    assert wrapper._qo_indptr_buf.data_ptr() == fi.graph_qo_indptr.data_ptr()
    assert fi.graph_kv_indptr[:4].tolist() == [0, 3, 9, 10]
    first = fi.forward(absorbed, rows, None, 0, fb).clone()
    shorter = [5, 23, 1]
    fb2 = _batch(shorter, [1, 1, 1], loc, ForwardMode.DECODE)
    fi.init_forward_metadata_replay_cuda_graph(3, fb2.req_pool_indices, fb2.seq_lens, shorter, ForwardMode.DECODE)
    assert fi.active is wrapper and fi.graph_kv_indptr[:4].tolist() == [0, 2, 8, 9]
    second = fi.forward(absorbed, rows, None, 0, fb2)
    assert torch.equal(second[1:], first[1:]) and not torch.equal(second[0], first[0])
    tn = TorchNativeMLABackend(table, pool, HEADS, SCALE)
    tn.init_forward_metadata(fb2)
    want = tn.forward(absorbed, rows, None, 0, fb2)
    assert (torch.einsum("thl,hvl->thv", (second.float() - want.float()), w_uv)).abs().max().item() < 3e-2
    with pytest.raises(ValueError, match="above the 4 allocated"):
        fi.init_forward_metadata_replay_cuda_graph(5, fb.req_pool_indices, fb.seq_lens, seq_lens, ForwardMode.DECODE)
    assert not fi.supports_graph_kv_widths and fi.get_cuda_graph_seq_len_fill_value() == 1


def test_backend_refuses_head_dims_dtypes_and_partial_pages():
    cls = _double()
    small = MLATokenToKVPool(15, 1, 32, 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(32, 8\)"):
        FlashInferMLABackend(ReqToTokenPool(2, 16), small, HEADS, SCALE, provider=_provider(cls))
    fp32 = MLATokenToKVPool(15, 1, LORA, ROPE, torch.float32)
    with pytest.raises(ValueError, match="float32"):
        FlashInferMLABackend(ReqToTokenPool(2, 16), fp32, HEADS, SCALE, provider=_provider(cls))
    odd = MLATokenToKVPool(16, 1, LORA, ROPE, torch.bfloat16)                           # 17 rows
    with pytest.raises(ValueError, match="whole number of 4-token pages"):
        FlashInferMLABackend(ReqToTokenPool(2, 16, page_size=4), odd, HEADS, SCALE, provider=_provider(cls))


def test_platform_builds_it_by_name_and_tbo_forwards_the_absorbed_form(monkeypatch):
    cls = _double()
    monkeypatch.setattr(flashinfer_mla_provider, "find_flashinfer_mla", lambda: _provider(cls))
    pool = MLATokenToKVPool(15, 1, LORA, ROPE, torch.bfloat16)
    ops = reference_platform()
    kw = dict(req_to_token_pool=ReqToTokenPool(2, 16), token_to_kv_pool=pool, num_heads=HEADS, softmax_scale=SCALE)
    be = ops.mla_attention_backend("flashinfer_mla", **kw)
    assert isinstance(be, FlashInferMLABackend) and be.mla_absorbed_extend
    assert TboAttnBackend.create(lambda: ops.mla_attention_backend("flashinfer_mla", **kw)).mla_absorbed_extend
    assert not ops.mla_attention_backend("torch_native", **kw).mla_absorbed_extend
    with pytest.raises(ValueError, match="no MLA implementation"):
        ops.mla_attention_backend("flash_attn", **kw)


# ------------------------------------------------------------------------------------- the double's checks
def _planned(**changes):
    """A planned double (decode of two requests over 1-token pages) and run() arguments; ``changes`` edit the
    plan's arguments first."""
    cls = _double()
    w = cls(torch.empty(16, dtype=torch.uint8))
    plan = dict(qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr=torch.tensor([0, 3, 5],
                dtype=torch.int32), kv_indices=torch.tensor([4, 1, 7, 2, 3], dtype=torch.int32),
                kv_len_arr=torch.tensor([3, 2], dtype=torch.int32), num_heads=HEADS, head_dim_ckv=LORA,
                head_dim_kpe=ROPE, page_size=1, causal=False, sm_scale=SCALE, q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16)
    plan.update(changes)
    run = dict(q_nope=torch.randn(2, HEADS, LORA).bfloat16(), q_pe=torch.randn(2, HEADS, ROPE).bfloat16(),
               ckv_cache=torch.randn(8, 1, LORA).bfloat16(), kpe_cache=torch.randn(8, 1, ROPE).bfloat16())
    return w, plan, run


PLAN_ERRORS = {
    "kv dtype int8": (dict(kv_data_type=torch.int8, q_data_type=torch.int8), ValueError, "not supported"),
    "fp8 cache": (dict(kv_data_type=torch.float8_e4m3fn), NotImplementedError, "FP8"),
    "float32": (dict(kv_data_type=torch.float16, q_data_type=torch.float32), RuntimeError, "one dtype"),
    "head dims": (dict(head_dim_ckv=32, head_dim_kpe=8), RuntimeError, "head_dim_ckv"),
    "negative kpe": (dict(head_dim_kpe=-1), ValueError, "head_dim_kpe must be >= 0"),
    "int64 indices": (dict(kv_indices=torch.tensor([4, 1, 7, 2, 3])), RuntimeError, "int32"),
    "pages short": (dict(kv_indptr=torch.tensor([0, 2, 4], dtype=torch.int32)), RuntimeError, "ceil"),
    "indices short": (dict(kv_indices=torch.tensor([4, 1], dtype=torch.int32)), RuntimeError, "needs 5"),
    "causal q > kv": (dict(causal=True, qo_indptr=torch.tensor([0, 4, 5], dtype=torch.int32)), RuntimeError,
                      "not supported for causal"),
}


@pytest.mark.parametrize("name", sorted(PLAN_ERRORS))
def test_double_makes_the_plan_checks(name):
    change, error, match = PLAN_ERRORS[name]
    w, plan, _ = _planned()
    plan.update(change)
    with pytest.raises(error, match=match):
        w.plan(**plan)


RUN_ERRORS = {
    "q dtype": (lambda a: a.update(q_nope=a["q_nope"].half()), ValueError, "q_data_type"),
    "cache dtype": (lambda a: a.update(kpe_cache=a["kpe_cache"].half()), ValueError, "kv_data_type"),
    "heads": (lambda a: a.update(q_nope=a["q_nope"][:, :2], q_pe=a["q_pe"][:, :2]), RuntimeError, "as planned"),
    "tokens": (lambda a: a.update(q_nope=a["q_nope"][:1], q_pe=a["q_pe"][:1]), RuntimeError, "as planned"),
    "strided last dim": (lambda a: a.update(ckv_cache=torch.randn(8, 1, 2 * LORA).bfloat16()[..., ::2]),
                         RuntimeError, "contiguous last dimension"),
    "page out of range": (lambda a: a.update(ckv_cache=a["ckv_cache"][:5], kpe_cache=a["kpe_cache"][:5]),
                          RuntimeError, "outside"),
    "fp8 scales": (lambda a: a.update(ckv_scale=1.0), ValueError, "only valid when kv_data_type is FP8"),
    "out shape": (lambda a: a.update(out=torch.empty(2, HEADS, 8).bfloat16()), ValueError, "Invalid shape of out"),
}


@pytest.mark.parametrize("name", sorted(RUN_ERRORS))
def test_double_makes_the_run_checks(name):
    mutate, error, match = RUN_ERRORS[name]
    w, plan, run = _planned()
    w.plan(**plan)
    mutate(run)
    with pytest.raises(error, match=match):
        w.run(**run)


def test_double_needs_plan_before_run_and_fixed_graph_batches():
    w, plan, run = _planned()
    with pytest.raises(AttributeError, match="_cached_module"):
        w.run(**run)
    cls = _double()
    bufs = dict(qo_indptr=torch.zeros(4, dtype=torch.int32), kv_indptr=torch.zeros(4, dtype=torch.int32),
                kv_indices=torch.zeros(6, dtype=torch.int32), kv_len_arr=torch.zeros(3, dtype=torch.int32))
    graph = cls(torch.empty(16, dtype=torch.uint8), use_cuda_graph=True, **bufs)
    with pytest.raises(RuntimeError, match="batch size is fixed"):
        graph.plan(**plan)                                   # 2 requests into a 3-request graph wrapper
    no_bufs = cls(torch.empty(16, dtype=torch.uint8), use_cuda_graph=True)
    with pytest.raises(AttributeError, match="copy_"):
        no_bufs.plan(**plan)
    out, lse = w.plan(**plan) or w.run(**run, return_lse=True)
    assert out.shape == (2, HEADS, LORA) and lse.shape == (2, HEADS) and lse.dtype == torch.float32


# ----------------------------------------------------------------------------------------------- the engine
PROMPTS = ["def fib(n):", "import os\nimport sys\n\n", "x", "The quick brown fox jumps over the lazy dog. " * 3]
SHARED = ("def helper(a, b, c):\n    \"\"\"Combine three values into a tuple and return it.\"\"\"\n"
          "    return (a, b, c)\n")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def v3_kernel_dims(tmp_path_factory):
    """A tiny DeepSeek-V3 with the latent dims the kernel is built for (512 + 64)."""
    return build("deepseek_v3", tmp_path_factory.mktemp("v3k") / "m",
                 overrides={"kv_lora_rank": LORA, "qk_rope_head_dim": ROPE})


@pytest.fixture(scope="module")
def reference(v3_kernel_dims):
    prompts = PROMPTS + [SHARED + p for p in PROMPTS[:2]]
    with Engine(v3_kernel_dims, disable_cuda_graph=True, max_context_len=256) as e:
        return {p: o.token_ids for p, o in zip(prompts, e.generate(prompts, GREEDY), strict=True)}


@pytest.fixture
def fi_double(monkeypatch):
    """The double as the provider, float32 allowed (engine parity in fp32, as the oracle tests)."""
    cls = _double(allow_float32=True)
    monkeypatch.setattr(flashinfer_mla_provider, "find_flashinfer_mla",
                        lambda: _provider(cls, ("float32", "bfloat16", "float16")))
    return cls


def _run(engine, prompts, reference):
    outs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == reference[p], f"prompt {p!r}"
    return outs


def test_engine_eager_chunked_prefill_and_radix_hits_match_torch_native(v3_kernel_dims, reference, fi_double):
    with Engine(v3_kernel_dims, attention_backend="flashinfer_mla", disable_cuda_graph=True, chunked_prefill_size=5,
                max_context_len=256) as e:
        _run(e, PROMPTS, reference)
        _run(e, [SHARED + PROMPTS[0]], reference)
        rest = _run(e, [SHARED + PROMPTS[1]], reference)
    assert fi_double.runs > 0 and rest[0].cached_tokens > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU double reads host values, which a CUDA graph "
                                                      "capture refuses; the GPU suite covers CUDA graphs")
def test_engine_decode_graphs_match_torch_native(v3_kernel_dims, reference, fi_double):
    with Engine(v3_kernel_dims, attention_backend="flashinfer_mla", cuda_graph_bs=(1, 2, 4),
                max_context_len=256) as e:
        _run(e, PROMPTS, reference)
        assert e.driver.num_graph_steps > 0
    assert fi_double.runs > 0


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here")
def test_flashinfer_mla_without_the_package_fails_at_config_time(v3_kernel_dims):
    with pytest.raises(BackendUnavailableError, match="flashinfer-python") as err:
        EngineConfig(model=v3_kernel_dims, attention_backend="flashinfer_mla")
    assert err.value.field == "attention_backend"


def test_flashinfer_mla_dtype_is_checked_at_config_time(v3_kernel_dims, monkeypatch):
    monkeypatch.setattr(flashinfer_mla_provider, "find_flashinfer_mla", lambda: _provider(_double()))
    with pytest.raises(InvalidRequestError, match="float32") as err:
        EngineConfig(model=v3_kernel_dims, attention_backend="flashinfer_mla", dtype="float32")
    assert err.value.field == "dtype"
    assert EngineConfig(model=v3_kernel_dims, attention_backend="flashinfer_mla", dtype="bfloat16").cache.page_size == 1


def test_flashinfer_mla_on_a_cpu_device_is_a_config_error_and_imports_stay_lazy(v3_kernel_dims, monkeypatch):
    import subprocess
    import sys

    from raymoe.platform.backends import environment_report

    monkeypatch.setattr(flashinfer_mla_provider, "find_flashinfer_mla", lambda: _provider(_double(), devices=("cuda",)))
    with pytest.raises(InvalidRequestError, match="CUDA only") as err:
        EngineConfig(model=v3_kernel_dims, device="cpu", dtype="bfloat16", attention_backend="flashinfer_mla")
    assert err.value.field == "attention_backend"
    assert environment_report()["attention_backend=flashinfer_mla"].startswith(
        "ok" if importlib.util.find_spec("flashinfer") else "missing")
    code = ("import sys, raymoe.platform.cuda.flashinfer_mla, raymoe.platform.selector; "
            "sys.exit(1 if 'flashinfer' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
