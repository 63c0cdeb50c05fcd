"""gpt-oss config normalization (layer types, windows, SwiGLU constants, quantization) and its refusals, and the
clamped SwiGLU experts over every layout a dispatch hands them against a per-row loop."""

from __future__ import annotations

import pytest
import torch

from raymoe.comm.expert_input import DenseExpertRows, ExpertRows, GroupedExpertRows, MaskedExpertRows
from raymoe.config import ModelConfig
from raymoe.config_arch import GptOssArch
from raymoe.layers.gpt_oss_moe import ClampedSwigluExperts, clamped_swiglu

BASE = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 16,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5}


def test_defaults_follow_transformers():
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert [cfg.attention_window(i) for i in range(4)] == [5, None, 5, None]
    assert cfg.gpt_oss == GptOssArch(1.702, 7.0)
    assert cfg.moe_intermediate_size == 16 and cfg.router.norm_topk_prob and cfg.is_moe_layer(0)
    bare = ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "sliding_window"})
    assert bare.sliding_window == 128 and bare.attention_bias  # transformers' GptOssConfig defaults


@pytest.mark.parametrize(("update", "match"), [
    ({"layer_types": ["full_attention"] * 3}, "3 entries for 4 layers"),
    ({"layer_types": ["linear_attention"] * 4}, "linear_attention"),
    ({"sliding_window": -3}, "sliding_window >= 1"),
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
])
def test_refusals(update, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**BASE, **update})


class _Experts:
    """Local experts as the expert operations read them (``ExpertWeights`` plus the biases)."""

    def __init__(self, e: int, h: int, i: int, gen: torch.Generator):
        self.num_local, self.expert_start = e, 0
        self.w13, self.b13 = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, 2 * i, generator=gen)
        self.w2, self.b2 = torch.randn(e, h, i, generator=gen) / i ** 0.5, torch.randn(e, h, generator=gen)
        self.prepared13 = self.prepared2 = None

    def row(self, x: torch.Tensor, e: int) -> torch.Tensor:
        h = clamped_swiglu(x @ self.w13[e].T + self.b13[e], 1.702, 1.5)
        return h @ self.w2[e].T + self.b2[e]


def test_clamped_swiglu_layouts_match_a_row_loop():
    gen = torch.Generator().manual_seed(0)
    ex, ops = _Experts(3, 8, 6, gen), ClampedSwigluExperts(GptOssArch(1.702, 1.5))
    x = 2 * torch.randn(7, 8, generator=gen)
    ids = torch.tensor([2, 0, 2, 1, 0, 0, 2])
    want = torch.stack([ex.row(x[r], int(ids[r])) for r in range(7)])
    assert torch.allclose(ExpertRows(x, ids).compute(ops, ex), want, atol=1e-5)
    order = torch.argsort(ids, stable=True)
    ends = torch.bincount(ids, minlength=3).cumsum(0).to(torch.int32)
    padded = torch.cat([x[order], torch.full((2, 8), 9.0)])                 # two padding rows
    assert torch.allclose(GroupedExpertRows(padded, ends, 7).compute(ops, ex)[:7], want[order], atol=1e-5)
    masked = torch.zeros(3, 4, 8)
    for e in range(3):
        rows = x[ids == e]
        masked[e, :rows.shape[0]] = rows
    got = MaskedExpertRows(masked, torch.bincount(ids, minlength=3).int(), max_rows=7).compute(ops, ex)
    for e in range(3):
        assert torch.allclose(got[e, :int((ids == e).sum())], want[ids == e], atol=1e-5)
    weights = torch.rand(7, 3, generator=gen)
    dense = sum(weights[:, e:e + 1] * torch.stack([ex.row(x[r], e) for r in range(7)]) for e in range(3))
    assert torch.allclose(DenseExpertRows(x, weights).compute(ops, ex), dense, atol=1e-4)
    clamped = 2.5 * 1.5 * torch.sigmoid(torch.tensor(1.702 * 1.5))           # both halves clamped to 1.5
    assert torch.allclose(clamped_swiglu(torch.full((1, 2), 100.0), 1.702, 1.5), clamped)
