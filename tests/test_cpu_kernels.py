"""The fused CPU kernels (``raymoe.platform.cpu.kernels``) against the torch operators they replace: norms, q/k norm
+ RoPE, KV store, paged decode attention, softmax top-k routing and routed experts; their argument checks (a bad index
raises before anything is written); the switch and the build fallback; and a whole model's prefill, decode and
mixed-step logits with the kernels on and off."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F

from raymoe.config_arch import RouterConfig
from raymoe.layers.router import select_experts
from raymoe.platform.cpu import attention as cpu_attention
from raymoe.platform.cpu.kernels import build, cpu_ops
from raymoe.platform.selector import select_platform

CPU = select_platform("cpu")
rms_norm = CPU.rms_norm

pytestmark = pytest.mark.skipif(build.load() is None,
                                reason="fused CPU kernels unavailable (no C compiler, or RAYMOE_CPU_KERNELS=0)")


@pytest.fixture
def kernels_off():
    """Run the body with the kernels switched off (torch paths); afterwards the environment decides again."""
    build.reset(enabled=False)
    yield
    build.reset()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,dim", [(1, 8), (16, 128), (37, 96)])
def test_add_rms_norm_matches_torch(rows, dim):
    g = _gen()
    base = torch.randn(rows, dim + 5, generator=g)
    x = base[:, 2:dim + 2]                                   # strided rows
    res, w = torch.randn(rows, dim, generator=g), torch.randn(dim, generator=g)
    out, h = cpu_ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.allclose(h, x + res, atol=0, rtol=0)
    assert torch.allclose(out, F.rms_norm(x + res, (dim,), w, 1e-6), atol=1e-6, rtol=1e-5)
    out, h = cpu_ops.add_rms_norm(x, None, w, 1e-6)
    assert h is x and torch.allclose(out, F.rms_norm(x, (dim,), w, 1e-6), atol=1e-6, rtol=1e-5)
    assert torch.allclose(rms_norm(x.contiguous(), w, 1e-6), out, atol=0, rtol=0)  # the layer takes the kernel


def _rope_tables(positions: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(positions).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_matches_torch(with_norm):
    t, hq, hkv, d = 9, 4, 2, 32
    g = _gen(1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    norm_w = torch.randn(hq + hkv, d, generator=g) if with_norm else None
    cos, sin = _rope_tables(64, d)
    pos = torch.randint(0, 64, (t,), generator=g)
    ref = rms_norm(qk, norm_w, 1e-6) if with_norm else qk.clone()
    ref = ref * cos[pos][:, None] + torch.cat((-ref[..., d // 2:], ref[..., :d // 2]), -1) * sin[pos][:, None]
    v_before = qkv[:, (hq + hkv) * d:].clone()
    cpu_ops.qk_norm_rope_(qk, norm_w, 1e-6, cos, sin, pos)
    assert torch.allclose(qk, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)   # values untouched


def test_qk_norm_rope_rejects_out_of_table_positions_before_writing():
    cos, sin = _rope_tables(16, 8)
    x = torch.randn(3, 2, 8)
    before = x.clone()
    with pytest.raises(IndexError, match="rotary table"):
        cpu_ops.qk_norm_rope_(x, None, 1e-6, cos, sin, torch.tensor([0, 16, 1]))
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="even"):
        cpu_ops.qk_norm_rope_(torch.randn(3, 2, 7), None, 1e-6, *_rope_tables(16, 7), torch.tensor([0, 1, 2]))


def test_kv_store_matches_index_put_and_checks_slots():
    g = _gen(2)
    kb, vb = torch.zeros(20, 2, 4), torch.zeros(20, 2, 4)
    kv = torch.randn(5, 3 * 2 * 4, generator=g)
    k, v = kv[:, :8].view(5, 2, 4), kv[:, 8:16].view(5, 2, 4)   # strided token rows
    loc = torch.tensor([3, 19, 0, 7, 11])
    cpu_ops.kv_store(k, v, loc, kb, vb)
    assert torch.equal(kb[loc], k) and torch.equal(vb[loc], v)
    before = kb.clone()
    with pytest.raises(IndexError, match="KV slot"):
        cpu_ops.kv_store(k, v, torch.tensor([1, 2, 20, 3, 4]), kb, vb)
    assert torch.equal(kb, before)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (4, 4, 32), (8, 1, 64), (4, 2, 128), (32, 1, 128)])
def test_decode_attention_matches_sdpa(hq, hkv, d):
    # head sizes 32/64/128 take the kernel's unrolled paths; 32 x 128 query heads per kv head exceed its accumulator
    slots, width = 300, 40
    g = _gen(3)
    kb, vb = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    lens = [1, 40, 7, 23, 0]                                  # 0: a padded row (attends to one slot)
    bs = len(lens)
    idx = torch.randint(0, slots, (bs, width + 3), generator=g)[:, :width]   # strided rows
    q_base = torch.randn(bs, hq + 2, d, generator=g)
    q = q_base[:, :hq]
    out = cpu_ops.decode_attention(q, kb, vb, idx, torch.tensor(lens), d ** -0.5)
    for b, n in enumerate(lens):
        n = max(n, 1)
        keys, vals = kb[idx[b, :n]].transpose(0, 1), vb[idx[b, :n]].transpose(0, 1)   # [Hkv, n, D]
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), keys, vals, enable_gqa=hq != hkv)
        assert torch.allclose(out[b], ref.squeeze(1), atol=2e-6, rtol=1e-5), b


def test_decode_attention_checks_slots_and_layout():
    kb = vb = torch.randn(10, 2, 8)
    q = torch.randn(2, 4, 8)
    with pytest.raises(IndexError, match="KV slot"):
        cpu_ops.decode_attention(q, kb, vb, torch.tensor([[1, 10], [2, 3]]), torch.tensor([2, 2]), 1.0)
    # a slot past a row's length is never read, so it need not be valid
    cpu_ops.decode_attention(q, kb, vb, torch.tensor([[1, 99], [2, 3]]), torch.tensor([1, 2]), 1.0)
    with pytest.raises(ValueError, match="multiple"):
        cpu_ops.decode_attention(torch.randn(2, 3, 8), kb, vb, torch.tensor([[1], [2]]), torch.tensor([1, 1]), 1.0)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_extend_attention_matches_causal_sdpa(hq, hkv):
    d, slots = 16, 300
    g = _gen(7)
    kb, vb = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    table = torch.randint(0, slots, (6, 50), generator=g)
    reqs = [(4, 0, 9), (1, 12, 5), (5, 30, 1)]               # (table row, cached prefix, new tokens)
    rows = torch.tensor([r for r, _, ext in reqs for _ in range(ext)])
    lens = torch.tensor([pre + j + 1 for _, pre, ext in reqs for j in range(ext)])
    q = torch.randn(len(rows), hq, d, generator=g)
    out = cpu_ops.extend_attention(q, kb, vb, table[:, :35], rows, lens, d ** -0.5)
    start = 0
    for r, pre, ext in reqs:
        sl = pre + ext
        keys, vals = kb[table[r, :sl]].transpose(0, 1), vb[table[r, :sl]].transpose(0, 1)   # [Hkv, sl, D]
        mask = torch.arange(sl)[None, :] <= torch.arange(pre, sl)[:, None]
        ref = F.scaled_dot_product_attention(q[start:start + ext].transpose(0, 1), keys, vals, attn_mask=mask,
                                             enable_gqa=hq != hkv)
        assert torch.allclose(out[start:start + ext], ref.transpose(0, 1), atol=2e-6, rtol=1e-5), r
        start += ext
    with pytest.raises(IndexError, match="token row"):
        cpu_ops.extend_attention(q, kb, vb, table[:4], rows, lens, 1.0)      # row 4 and 5 past the table
    with pytest.raises(IndexError, match="token row"):
        cpu_ops.extend_attention(q, kb, vb, table, rows - 5, lens, 1.0)      # negative rows


def test_sample_rows_inverts_the_tempered_cdf():
    g = _gen(8)
    bs, vocab = 300, 1000                                      # 1000: a partial last block of the kernel's sums
    logits = torch.randn(bs, vocab, generator=g) * 3
    logits[:, 990:] = float("-inf")                            # masked tokens: zero weight, never drawn
    temps = torch.tensor([0.0, 0.7, 1.0, 1.5] * (bs // 4))
    u = torch.rand(bs, generator=g)
    u[1], u[2] = 0.0, 1.0 - 2 ** -24                           # the ends of [0, 1)
    ids = cpu_ops.sample_rows(logits, temps, u)
    t64 = torch.where(temps == 0, 1.0, temps).double()
    p = torch.softmax(logits.double() / t64[:, None], dim=-1)
    cdf = p.cumsum(-1)
    want = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=vocab - 1)
    want = torch.where(temps == 0, logits.argmax(-1), want)
    differ = (ids != want).nonzero()[:, 0].tolist()
    for b in differ:  # only where the draw lies within float32 rounding of a cdf step
        assert abs(cdf[b, want[b]].item() - u[b].item()) < 1e-5 or abs(cdf[b, ids[b]].item() - u[b].item()) < 1e-5, b
    assert len(differ) <= 2
    assert (ids < 990).all()
    with pytest.raises(ValueError, match="temperatures"):
        cpu_ops.sample_rows(logits[:2], torch.tensor([1.0, -1.0]), u[:2])


def test_sampler_draws_the_same_tokens_with_kernels_on_and_off(kernels_off):
    from raymoe.runner.forward_batch import SamplingBatchInfo
    from raymoe.runner.sampler import Sampler
    from raymoe.step.sampling_inputs import SamplingInputs

    bs = 64
    logits = torch.randn(bs, 8192, generator=_gen(9)) * 2
    temps = [0.0, 0.5, 1.0, 1.3] * (bs // 4)
    seeds = [None, 11] * (bs // 2)
    info = SamplingBatchInfo.from_inputs(SamplingInputs(
        temperatures=temps, top_ps=[1.0] * bs, top_ks=[-1] * bs, min_ps=[0.0] * bs, seeds=seeds,
        output_lens=list(range(bs)), logprobs=[None] * bs), "cpu")
    off = Sampler(CPU, seed=5)(logits, info)[0]
    build.reset(enabled=True)
    on = Sampler(CPU, seed=5)(logits, info)[0]
    assert (on != off).sum() <= 1                              # the same draws; at most a rounding-edge draw differs


@pytest.mark.parametrize("experts,k,renorm,scale", [(8, 2, True, 1.0), (64, 6, False, 2.5), (4, 4, True, 1.0)])
def test_topk_softmax_matches_select_experts(experts, k, renorm, scale, kernels_off):
    logits = torch.randn(33, experts, generator=_gen(4))
    cfg = RouterConfig(norm_topk_prob=renorm, routed_scaling_factor=scale)
    ref_w, ref_ids = select_experts(CPU, logits, k, cfg)           # torch path (kernels off)
    build.reset(enabled=True)
    w, ids = cpu_ops.topk_softmax(logits, k, renorm, scale)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w, atol=1e-6, rtol=1e-5)
    got_w, got_ids = select_experts(CPU, logits, k, cfg)           # the router takes the kernel
    assert torch.equal(got_ids, ids) and torch.equal(got_w, w)


def test_topk_softmax_breaks_ties_to_the_lower_id():
    w, ids = cpu_ops.topk_softmax(torch.tensor([[0.5, 2.0, 2.0, 0.5, 2.0]]), 3, True)
    assert ids.tolist() == [[1, 2, 4]]
    assert torch.allclose(w, torch.full((1, 3), 1 / 3))


@pytest.mark.parametrize("first_expert", [0, 6])
def test_routed_rows_match_batched_experts(first_expert, kernels_off):
    """The kernel over blocked, strided token rows with their own routing equals the torch path (dense weights,
    batched GEMMs); other ranks' and padding ids are skipped, and a row with no pick here answers exact zeros
    without its (NaN) inputs being read."""
    from raymoe.comm.expert_input import RoutedTokenRows
    from raymoe.comm.groups import ParallelGroups
    from raymoe.layers.moe import LocalExperts

    g = _gen(5)
    e_local, e_total, k, blocks, m, h = 6, 12, 3, 2, 7, 24
    ex = LocalExperts(e_local, h, 10, ParallelGroups.single(), torch.float32, CPU)
    ex.w13.data.copy_(torch.randn(ex.w13.shape, generator=g) * 0.3)
    ex.w2.data.copy_(torch.randn(ex.w2.shape, generator=g) * 0.3)
    # messages: [blocks, rows + 2 spare rows, h] with the routing in their own strided buffers
    x = torch.randn(blocks, m + 2, h, generator=g)[:, :m]
    ids = torch.stack([torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(m)])
                       for _ in range(blocks)])
    ids[0, 0] = torch.arange(first_expert, first_expert + k)          # three local picks
    ids[1, 1:3] = e_total                                               # padding rows: no expert anywhere
    wts = torch.rand(blocks, m, k + 1, generator=g)[..., :k]
    x[1, 1:3] = float("nan")
    wts[1, 1:3] = float("nan")
    rows = RoutedTokenRows(x, ids, wts, first_expert)
    ref = ex.forward_input(rows)                                        # dense weights, batched GEMMs (kernels off)
    build.reset(enabled=True)
    out = ex.forward_input(rows)
    padding = torch.tensor([1 * m + 1, 1 * m + 2])
    keep = torch.ones(blocks * m, dtype=torch.bool).index_fill_(0, padding, False)
    assert torch.allclose(out[keep], ref[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[padding], torch.zeros(2, h))
    none_here = ((ids < first_expert) | (ids >= first_expert + e_local)).all(-1).view(-1)
    assert torch.equal(out[none_here], torch.zeros(int(none_here.sum()), h))


def test_enabled_for_dtype_device_and_switch(kernels_off, monkeypatch):
    x = torch.randn(2, 4)
    assert not cpu_ops.enabled_for(x)                        # switched off
    build.reset(enabled=True)
    assert cpu_ops.enabled_for(x)
    assert not cpu_ops.enabled_for(x, x.double())
    assert not cpu_ops.enabled_for(x.bfloat16())
    assert not cpu_ops.enabled_for(torch.empty(2, 4, device="meta"))
    monkeypatch.setenv("RAYMOE_CPU_KERNELS", "0")            # the environment decides after reset()
    build.reset()
    assert not cpu_ops.enabled_for(x)
    monkeypatch.setenv("RAYMOE_CPU_KERNELS", "1")
    build.reset()
    assert cpu_ops.enabled_for(x)


def test_reset_never_writes_the_environment(monkeypatch):
    monkeypatch.delenv("RAYMOE_CPU_KERNELS", raising=False)
    try:
        build.reset(enabled=False)
        assert "RAYMOE_CPU_KERNELS" not in os.environ and build.load() is None
    finally:
        build.reset()
    assert build.load() is not None


def test_build_caches_and_falls_back_without_a_compiler(monkeypatch, tmp_path, caplog):
    cc = build._compiler()
    monkeypatch.setenv("RAYMOE_CACHE_DIR", str(tmp_path))
    path = build.build(cc)
    assert path.exists() and path.parent == tmp_path / "kernels"
    built = path.stat().st_mtime_ns
    assert build.build(cc) == path and path.stat().st_mtime_ns == built   # cached: not rebuilt
    monkeypatch.setattr(build, "_compiler", lambda: None)
    build.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="raymoe.platform.cpu.kernels.build"):
            assert build.load() is None
        assert "no C compiler" in caplog.text
        assert not cpu_ops.enabled_for(torch.randn(2))
        x, w = torch.randn(3, 8), torch.randn(8)
        assert torch.allclose(rms_norm(x, w, 1e-6), F.rms_norm(x, (8,), w, 1e-6))   # torch path
    finally:
        monkeypatch.undo()
        build.reset()


def test_build_error_names_the_compiler_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "CFLAGS", (*build.CFLAGS, "-Werror=this-flag-does-not-exist"))
    with pytest.raises(RuntimeError, match="failed on the kernel sources"):
        build.build(build._compiler())
    assert not list((tmp_path / "kernels").glob("*.so"))      # no half-written library left behind


def _decode_logits(model_path: str, graphs: bool) -> torch.Tensor:
    from raymoe.config import GraphConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig
    from raymoe.step.forward_mode import ForwardMode
    from raymoe.step.sampling_inputs import SamplingInputs
    from raymoe.step.worker_batch import ModelWorkerBatch

    bs, prompt = 3, 6
    runner = ModelRunner(RunnerConfig(model_path=model_path, dtype="float32", num_kv_slots=256, max_req_rows=4,
                                      max_context_len=32,
                                      graph=GraphConfig(disable_cuda_graph=not graphs, cuda_graph_bs=(4,))))
    logits = []
    sample = runner.sampler.sample
    runner.sampler.sample = lambda lg, sampling: (logits.append(lg.clone()), sample(lg, sampling))[1]
    ids = torch.randint(1, 100, (bs * prompt,), generator=_gen(6)).tolist()
    runner.forward_batch_generation(ModelWorkerBatch(
        ForwardMode.EXTEND, ids, list(range(bs)), [prompt] * bs, [0] * bs, [prompt] * bs,
        list(range(1, bs * prompt + 1)), [], sampling=SamplingInputs.greedy(bs), global_num_tokens=(bs * prompt,)))
    slot = bs * prompt + 1
    for step in range(4):
        batch = ModelWorkerBatch(ForwardMode.DECODE, [7 + step] * bs, list(range(bs)), [prompt + step + 1] * bs,
                                 [prompt + step] * bs, [1] * bs, list(range(slot, slot + bs)), [],
                                 sampling=SamplingInputs.greedy(bs), global_num_tokens=(bs,),
                                 graph_bs=4 if graphs else None)
        slot += bs
        runner.forward_batch_generation(batch)
    # a second chunk of request 0's prompt after its cached tokens, beside a decode row (MIXED)
    seq0, seq1 = prompt + 4, prompt + 4
    runner.forward_batch_generation(ModelWorkerBatch(
        ForwardMode.MIXED, [11, 12, 13, 14], [0, 1], [seq0 + 3, seq1 + 1], [seq0, seq1], [3, 1],
        list(range(slot, slot + 4)), [], sampling=SamplingInputs.greedy(2), global_num_tokens=(4,),
        table_lens=[seq0, seq1]))
    return torch.cat(logits)


@pytest.mark.parametrize("graphs,max_pairs", [(False, None), (True, None), (False, 12)])
def test_model_decode_logits_equal_with_kernels_on_and_off(tiny_model, graphs, max_pairs, kernels_off,
                                                           monkeypatch):
    if max_pairs is not None:  # the MIXED step's 3-token chunk (36 pairs) takes SDPA, its decode row (11) the kernel
        monkeypatch.setattr(cpu_attention, "EXTEND_KERNEL_MAX_PAIRS", max_pairs)
    off = _decode_logits(tiny_model, graphs)
    build.reset(enabled=True)
    on = _decode_logits(tiny_model, graphs)
    assert torch.allclose(on, off, atol=1e-4, rtol=1e-4)
    assert torch.equal(on.argmax(-1), off.argmax(-1))
