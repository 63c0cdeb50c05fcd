"""Gated DeltaNet numerics (raymoe.layers.gated_delta) against transformers' Qwen3.5-MoE torch reference functions,
in float32: the conv and the delta rule with per-request states carried across chunks and decode steps, grouped
value heads, the gated RMSNorm and a whole ``Qwen3_5MoeGatedDeltaNet`` layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raymoe.layers.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    decay_and_beta,
    gated_rms_norm,
    recurrent_gated_delta_rule,
)

hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

RTOL = 1e-4


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> float:
    """Assert max |got - want| <= rtol * max |want| (and same shape); return the relative error."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert want.abs().max() > 0
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= rtol, err
    return err


def hf_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' fresh causal conv + SiLU over x [n, C] -> [n, C]."""
    return hf.causal_conv1d_fn(x.t().unsqueeze(0), w, activation="silu")[0].t()


def inputs(n: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    """Seeded q, k [n, hk, dk], v [n, hv, dv], g [n, hv] (<= 0, some strong decay) and beta [n, hv]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hk, dk, generator=gen)
    k = torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(n, hv, generator=gen)) * 0.5
    beta = torch.rand(n, hv, generator=gen)
    return q, k, v, g, beta


def hf_chunk(q, k, v, g, beta, state=None):
    """transformers' chunked rule over one request (batch of 1)."""
    out, s = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=None if state is None else state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], s[0]


@pytest.mark.parametrize("cuts", [[3, 1, 2, 9], [1, 1, 1, 1]])
def test_conv_prefill_continued_equals_whole(cuts):
    torch.manual_seed(0)
    C, K = 12, 4
    n = sum(cuts)
    x, w = torch.randn(n, C), torch.randn(C, K)
    want = hf_conv(x, w)
    state = torch.zeros(C, K - 1)
    ys, start = [], 0
    for m in cuts:  # chunks shorter than K-1 keep part of the old state
        y, state = causal_conv1d_prefill(x[start : start + m], w, state)
        ys.append(y)
        start += m
        assert torch.equal(state, F.pad(x[:start], (0, 0, K - 1, 0))[-(K - 1) :].t())
    close(torch.cat(ys), want)


def test_conv_prefill_fresh_and_dtype():
    torch.manual_seed(1)
    x, w = torch.randn(7, 5), torch.randn(5, 3)
    y, state = causal_conv1d_prefill(x, w, torch.zeros(5, 2))
    close(y, hf_conv(x, w))
    assert torch.equal(state, x[-2:].t())
    yb, sb = causal_conv1d_prefill(x.bfloat16(), w, torch.zeros(5, 2))
    assert yb.dtype == torch.bfloat16 and sb.dtype == torch.float32
    with pytest.raises(ValueError):
        causal_conv1d_prefill(x, w, torch.zeros(5, 3))


def test_conv_decode_after_prefill_equals_whole():
    torch.manual_seed(2)
    B, C, K, n0, steps = 3, 10, 4, [5, 2, 1], 4
    w = torch.randn(C, K)
    xs = [torch.randn(m + steps, C) for m in n0]
    states = []
    for x, m in zip(xs, n0, strict=True):
        _, s = causal_conv1d_prefill(x[:m], w, torch.zeros(C, K - 1))
        states.append(s)
    states = torch.stack(states)
    for t in range(steps):
        xt = torch.stack([x[m + t] for x, m in zip(xs, n0, strict=True)])
        # transformers' update keeps a K-wide state; its oldest column does not reach the output
        hf_state = torch.cat([torch.randn(B, C, 1), states], dim=-1)
        want = hf.causal_conv1d_update(xt.unsqueeze(-1), hf_state, w, activation="silu")[..., 0]
        y, states = causal_conv1d_decode(xt, w, states)
        close(y, want)
        for i, (x, m) in enumerate(zip(xs, n0, strict=True)):
            close(y[i], hf_conv(x[: m + t + 1], w)[-1])
            assert torch.equal(states[i], hf_state[i, :, 1:])  # updated in place


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (2, 4, 12, 20)])
def test_chunk_rule_whole_and_cut_prompt(hk, hv, dk, dv):
    n = 150
    q, k, v, g, beta = inputs(n, hk, hv, dk, dv)
    want, want_s = hf_chunk(q, k, v, g, beta)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, None)
    close(out, want)
    close(s, want_s)
    # the same prompt in chunks of 5, 64, 70 and the rest (11), the state carried across them
    outs, state, start = [], torch.zeros(hv, dk, dv), 0
    for m in (5, 64, 70, 11):
        sl = slice(start, start + m)
        o, state = chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], state)
        outs.append(o)
        start += m
    close(torch.cat(outs), want)
    close(state, want_s)
    # an odd chunk size, from a nonzero state
    s0 = torch.randn(hv, dk, dv)
    want2, want2_s = hf_chunk(q, k, v, g, beta, s0)
    out2, s2 = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=7)
    close(out2, want2)
    close(s2, want2_s)


def test_recurrent_rule_batch_matches_per_request():
    B, hk, hv, dk, dv = 3, 2, 4, 12, 20
    q, k, v, g, beta = inputs(B, hk, hv, dk, dv, seed=3)
    states = torch.randn(B, hv, dk, dv, generator=torch.Generator().manual_seed(4))
    out, new = recurrent_gated_delta_rule(q, k, v, g, beta, states)
    assert not torch.equal(new, states)
    for i in range(B):
        sl = slice(i, i + 1)
        want, want_s = hf.torch_recurrent_gated_delta_rule(
            q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl],
            initial_state=states[i : i + 1], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        close(out[i], want[0, 0])
        close(new[i], want_s[0])


def test_prefill_then_decode_equals_whole_chunk():
    B, hk, hv, dk, dv, steps = 3, 2, 4, 12, 20, 5
    prompts = [70, 9, 1]
    reqs = [inputs(m + steps, hk, hv, dk, dv, seed=10 + i) for i, m in enumerate(prompts)]
    states, outs = [], [[] for _ in range(B)]
    for i, m in enumerate(prompts):
        o, s = chunk_gated_delta_rule(*(t[:m] for t in reqs[i]), None)
        outs[i].append(o)
        states.append(s)
    states = torch.stack(states)
    for t in range(steps):
        step = [torch.stack([r[j][m + t] for r, m in zip(reqs, prompts, strict=True)]) for j in range(5)]
        o, states = recurrent_gated_delta_rule(*step, states)
        for i in range(B):
            outs[i].append(o[i : i + 1])
    for i in range(B):
        want, want_s = hf_chunk(*reqs[i])
        close(torch.cat(outs[i]), want)
        close(states[i], want_s)


def test_gated_rms_norm_and_decay():
    torch.manual_seed(5)
    ref = hf.Qwen3_5MoeRMSNormGated(24, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(24))
    x, z = torch.randn(6, 4, 24), torch.randn(6, 4, 24)
    close(gated_rms_norm(x, z, ref.weight.detach(), 1e-6), ref(x, z).detach(), rtol=1e-6)
    a, b, A_log, dt = torch.randn(5, 4), torch.randn(5, 4), torch.randn(4), torch.randn(4)
    g, beta = decay_and_beta(a, b, A_log, dt)
    assert g.dtype == torch.float32 and (g <= 0).all()
    close(g, -A_log.exp() * torch.log1p((a + dt).exp()), rtol=1e-5)
    close(beta, 1 / (1 + (-b).exp()), rtol=1e-6)


def test_whole_layer_matches_transformers():
    from transformers import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(6)
    layer = hf.Qwen3_5MoeGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        layer.dt_bias.copy_(torch.randn(4))
        layer.norm.weight.copy_(1 + 0.3 * torch.randn(24))
    n = 80
    h = torch.randn(n, 64)
    with torch.no_grad():
        want = layer(h[None])[0]
        W = {name: p.detach() for name, p in layer.named_parameters()}
        qkv = h @ W["in_proj_qkv.weight"].t()
        mixed, _ = causal_conv1d_prefill(qkv, W["conv1d.weight"][:, 0], torch.zeros(qkv.shape[1], 3))
        q, k, v = mixed.split([32, 32, 96], dim=-1)  # conv channels are q | k | v
        g, beta = decay_and_beta(h @ W["in_proj_a.weight"].t(), h @ W["in_proj_b.weight"].t(), W["A_log"], W["dt_bias"])
        o, _ = chunk_gated_delta_rule(q.reshape(n, 2, 16), k.reshape(n, 2, 16), v.reshape(n, 4, 24), g, beta, None)
        z = (h @ W["in_proj_z.weight"].t()).reshape(n, 4, 24)
        got = gated_rms_norm(o, z, W["norm.weight"], cfg.rms_norm_eps).reshape(n, 96) @ W["out_proj.weight"].t()
    close(got, want)
