"""The fused decode attention block (``raymoe.platform.cpu.kernels.attn_block``) against the torch operators it
replaces, its index checks, and the model's decode logits with the block on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raymoe.platform.cpu.kernels import attn_block, build, packed_linear
from raymoe.platform.cpu.kernels.attn_block import AttnBlockPlan, BlockAttentionInputs
from raymoe.platform.cpu.platform import CpuPlatform

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler for the fused CPU kernels")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _setup(hq: int, hkv: int, d: int, hidden: int, experts: int, qk_norm: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    table = 64
    pos = torch.arange(table, dtype=torch.float32)[:, None] / (100.0 ** (torch.arange(d // 2) / (d // 2)))
    emb = torch.cat((pos, pos), dim=-1)
    w = {"ln1_w": 1 + r(hidden), "ln2_w": 1 + r(hidden), "norm_eps": 1e-6, "w_qkv": r((hq + 2 * hkv) * d, hidden),
         "w_o": r(hidden, hq * d), "qk_norm_w": (1 + r(hq + hkv, d)) if qk_norm else None, "qk_eps": 1e-5,
         "cos": emb.cos().contiguous(), "sin": emb.sin().contiguous(), "heads": hq, "kv_heads": hkv, "head_dim": d,
         "scale": d ** -0.5}
    if experts:
        w.update(w_gate=r(experts, hidden, scale=1.0), top_k=2, renorm=True, routed_scale=1.5)
    return w


def _reference(w: dict, x, positions, loc, k_buf, v_buf, kv_indices, seq_lens, token_rows=None):
    hq, hkv, d = w["heads"], w["kv_heads"], w["head_dim"]
    t = x.shape[0]
    h = _rms(x, w["ln1_w"], w["norm_eps"])
    qkv = h @ w["w_qkv"].T
    qk = qkv[:, :(hq + hkv) * d].reshape(t, hq + hkv, d)
    if w["qk_norm_w"] is not None:
        qk = _rms(qk, w["qk_norm_w"], w["qk_eps"])
    qk = _rope(qk, w["cos"][positions], w["sin"][positions])
    q, k = qk[:, :hq], qk[:, hq:]
    v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    k_buf[loc], v_buf[loc] = k, v
    out = torch.empty(t, hq, d)
    for i in range(t):
        n = min(max(int(seq_lens[i]), 1), kv_indices.shape[1])
        slots = kv_indices[i if token_rows is None else int(token_rows[i]), :n]
        keys = k_buf[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)      # [Hq, n, D]
        values = v_buf[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(q[i][:, None], keys, values, scale=w["scale"])[:, 0]
    residual = x + out.reshape(t, hq * d) @ w["w_o"].T
    hidden = _rms(residual, w["ln2_w"], w["norm_eps"])
    if "w_gate" not in w:
        return residual, hidden, None, None
    probs = torch.softmax(hidden @ w["w_gate"].T, dim=-1)
    weights, ids = torch.topk(probs, w["top_k"], dim=-1)
    return residual, hidden, weights / weights.sum(-1, keepdim=True) * w["routed_scale"], ids


@pytest.mark.parametrize("hq,hkv,d,experts,qk_norm", [(4, 2, 32, 8, True), (8, 8, 16, 0, False),
                                                      (6, 2, 64, 4, True)])
def test_block_matches_the_torch_operators(hq, hkv, d, experts, qk_norm):
    w = _setup(hq, hkv, d, hidden=48, experts=experts, qk_norm=qk_norm)
    plan = AttnBlockPlan(**w)
    t, slots, width = 7, 80, 20
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, 48, generator=g)
    seq_lens = torch.tensor([1, 5, 12, 20, 3, 0, 9])                      # 0: a padded graph row (attends to 1)
    positions = (seq_lens - 1).clamp(min=0)
    loc = torch.tensor([3, 17, 29, 41, 53, 0, 77])
    kv_indices = torch.randint(1, slots, (t, width), generator=g)
    kv_indices[torch.arange(t), positions] = loc                          # each row reads its new token back
    k_buf, v_buf = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    kr, vr = k_buf.clone(), v_buf.clone()
    got = plan(x, positions, loc, BlockAttentionInputs(k_buf, v_buf, kv_indices, None, seq_lens))
    want = _reference(w, x, positions, loc, kr, vr, kv_indices, seq_lens)
    assert torch.allclose(k_buf, kr, atol=1e-5) and torch.allclose(v_buf, vr, atol=1e-5)
    for a, b in zip(got[:3], want[:3], strict=True):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-4, rtol=1e-4))
    if experts:
        assert torch.equal(got[3], want[3])


def test_block_extend_tokens_attend_causally_through_their_request_rows():
    """A MIXED step: request 0 extends 3 tokens after 4 cached ones, request 1 decodes one, request 2 prefills 2;
    every token reads its request's table row up to itself."""
    w = _setup(4, 2, 32, hidden=48, experts=8, qk_norm=True, seed=3)
    plan = AttnBlockPlan(**w)
    g = torch.Generator().manual_seed(4)
    table = torch.randint(1, 64, (5, 16), generator=g)                    # ReqToTokenPool rows, 5 requests
    token_rows = torch.tensor([0, 0, 0, 3, 1, 1])
    positions = torch.tensor([4, 5, 6, 9, 0, 1])
    lens = positions + 1
    loc = table[token_rows, positions]                                    # each token's own slot, from its row
    x = torch.randn(6, 48, generator=g)
    k_buf, v_buf = torch.randn(64, 2, 32, generator=g), torch.randn(64, 2, 32, generator=g)
    kr, vr = k_buf.clone(), v_buf.clone()
    got = plan(x, positions, loc, BlockAttentionInputs(k_buf, v_buf, table, token_rows, lens))
    want = _reference(w, x, positions, loc, kr, vr, table, lens, token_rows)
    assert torch.allclose(k_buf, kr, atol=1e-5) and torch.allclose(v_buf, vr, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4)
    with pytest.raises(IndexError, match="token row"):
        plan(x, positions, loc, BlockAttentionInputs(k_buf, v_buf, table, token_rows + 2, lens))


def test_block_checks_indices_before_writing():
    w = _setup(4, 2, 32, hidden=48, experts=8, qk_norm=True)
    plan = AttnBlockPlan(**w)
    x = torch.randn(2, 48)
    k_buf, v_buf = torch.zeros(16, 2, 32), torch.zeros(16, 2, 32)
    ok = {"positions": torch.tensor([0, 1]), "loc": torch.tensor([1, 2]), "kv_indices": torch.tensor([[1], [2]]),
          "seq_lens": torch.tensor([1, 1])}
    bad = [("positions", torch.tensor([0, 64]), "rotary table"), ("loc", torch.tensor([1, 16]), "KV slot"),
           ("kv_indices", torch.tensor([[1], [-1]]), "KV slot")]
    for name, value, match in bad:
        args = {**ok, name: value}
        with pytest.raises(IndexError, match=match):
            plan(x, args["positions"], args["loc"],
                 BlockAttentionInputs(k_buf, v_buf, args["kv_indices"], None, args["seq_lens"]))
        assert not k_buf.any() and not v_buf.any()
    with pytest.raises(ValueError, match="lens"):
        plan(x, ok["positions"], ok["loc"],
             BlockAttentionInputs(k_buf, v_buf, ok["kv_indices"], None, torch.tensor([1, 1], dtype=torch.int32)))


def test_plan_rejects_weights_it_cannot_take():
    w = _setup(4, 2, 32, hidden=48, experts=8, qk_norm=True)
    with pytest.raises(ValueError, match="w_o"):
        AttnBlockPlan(**{**w, "w_o": w["w_o"].T})
    with pytest.raises(ValueError, match="top_k"):
        AttnBlockPlan(**{**w, "top_k": 9})
    with pytest.raises(ValueError, match="w_qkv"):
        AttnBlockPlan(**{**w, "w_qkv": w["w_qkv"].double()})
    packed_qkv = packed_linear.pack(w["w_qkv"])
    with pytest.raises(ValueError, match="packed copy"):
        AttnBlockPlan(**{**w, "w_o_packed": packed_qkv})


def test_plan_reads_the_packed_copies_it_is_given():
    """The layers' packed copies are used in place (no second copy), and projections given none are packed."""
    w = _setup(4, 2, 32, hidden=48, experts=8, qk_norm=True)
    given = {"w_qkv_packed": packed_linear.pack(w["w_qkv"]), "w_gate_packed": packed_linear.pack(w["w_gate"])}
    plan = AttnBlockPlan(**w, **given)
    qkv, o, gate = plan.packed
    assert qkv is given["w_qkv_packed"] and gate is given["w_gate_packed"]
    assert (o.out_features, o.in_features) == tuple(w["w_o"].shape)


def test_model_decode_uses_the_block_and_keeps_its_logits(tiny_model, monkeypatch):
    """A prefill, decode steps (eager and graphs) and a MIXED step of the tiny model: the same logits and greedy
    tokens with the fused block as with the layer's ops one by one, and the block ran once per layer and step."""
    from test_cpu_kernels import _decode_logits

    calls = []
    real = AttnBlockPlan.__call__
    monkeypatch.setattr(AttnBlockPlan, "__call__", lambda self, *a: (calls.append(1), real(self, *a))[1])
    fused = [_decode_logits(tiny_model, graphs) for graphs in (False, True)]
    assert len(calls) == 2 * 4 * 6 + 4  # (prefill, 4 decode steps, MIXED) x 4 layers, twice; a graph capture
    monkeypatch.setattr(attn_block, "ATTN_BLOCK_MAX_MACS", 8 * 50_176)  # 8 rows of this model (50,176 MACs each)
    assert torch.allclose(_decode_logits(tiny_model, False), fused[0], atol=1e-4, rtol=1e-4)
    assert len(calls) == 52 + 4 * 5           # the 18-token prefill ran the ops; decode and MIXED steps the block
    monkeypatch.setattr(attn_block, "ATTN_BLOCK_MAX_MACS", 8 * 50_176 - 1)  # a layer too large for 8 rows: no plan
    assert torch.allclose(_decode_logits(tiny_model, False), fused[0], atol=1e-4, rtol=1e-4)
    assert len(calls) == 72
    monkeypatch.setattr(CpuPlatform, "fusions", lambda self: ())  # the layers' ops one by one
    for got, graphs in zip(fused, (False, True), strict=True):
        want = _decode_logits(tiny_model, graphs)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_plan_only_for_layers_a_useful_batch_fits():
    small = _setup(4, 2, 32, hidden=128, experts=8, qk_norm=True)
    assert attn_block.plan_fits(small, small)                      # the tiny model: 50 k MACs a row
    big = _setup(16, 4, 64, hidden=1024, experts=8, qk_norm=True)  # the overlap bench's layer: 2.6 M a row
    assert not attn_block.plan_fits(big, big)
