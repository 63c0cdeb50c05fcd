"""``make_checkpoint(router_skew=S)``: S = 0 is today's checkpoint, S = 1 skews the expert load as trained models do,
measured with transformers (``router_load``), and bad values are refused."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raymoe.cli import main
from raymoe.errors import InvalidRequestError
from raymoe.models.checkpoint import make_checkpoint
from raymoe.models.router_skew import (
    SEED_SALT,
    SHARED_RATIO,
    apply_router_skew,
    hot_share,
    rank_share,
    router_load,
    shared_direction,
)

SMALL = dict(num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, moe_intermediate_size=32,
             intermediate_size=64, vocab_size=512)
# sha256 (first 16 hex digits) of every tensor's name and bytes, in name order, of make_checkpoint(arch, seed=3,
# num_experts=8, **SMALL) as built before router_skew existed (torch 2.13 CPU). A builder change that is meant to
# change the weights updates these.
TODAY = {"qwen3_moe": "d1647cb034fc0c56", "deepseek_v3": "af1c2254cecb958e", "deepseek_v2": "b91c2bdcd24f3f5d",
         "mixtral": "cf071308e01a97b9", "gpt_oss": "9d6cce2a25085472"}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("arch", sorted(TODAY))
def test_zero_skew_builds_todays_tensors(arch, tmp_path):
    path = make_checkpoint(arch, tmp_path / arch, seed=3, num_experts=8, router_skew=0.0, **SMALL)
    assert _digest(_tensors(path)) == TODAY[arch]
    assert "router_skew" not in json.loads((path / "raymoe_build.json").read_text())


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_skew_one_meets_the_target_in_transformers(arch, tmp_path):
    """S = 1: in every MoE layer the hottest eighth of the experts takes >= 50 % of the routed pairs, and with two
    contiguous expert blocks the busier one takes >= 65 % in most layers; with S = 0 the hottest eighth stays under
    half."""
    from transformers import AutoModelForCausalLM

    flat = make_checkpoint(arch, tmp_path / "flat", num_experts=16, **SMALL)
    skewed = make_checkpoint(arch, tmp_path / "skewed", num_experts=16, router_skew=1.0, **SMALL)
    assert json.loads((skewed / "raymoe_build.json").read_text())["router_skew"] == 1.0
    load, before = router_load(skewed), router_load(flat)
    moe_layers = 3 if arch == "qwen3_moe" else 2                # DeepSeek's layer 0 is dense
    assert load.shape == before.shape == (moe_layers, 16) and load.dtype == torch.int64
    assert (load.sum(1) == 64 * 32 * 2).all()
    hot, busier = hot_share(load), rank_share(load, ep=2)
    print(f"{arch}: hottest eighth {hot.tolist()}, busier half {busier.tolist()}; S=0: {hot_share(before).tolist()}")
    assert (hot >= 0.5).all(), hot
    assert (busier >= 0.65).sum() > moe_layers / 2, busier
    assert (hot_share(before) < 0.5).all()
    assert load.argmax(1).unique().numel() > 1, "the same expert is hottest in every layer"
    model = AutoModelForCausalLM.from_pretrained(skewed, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(("arch", "bias"), [("deepseek_v3", "mlp.gate.e_score_correction_bias"),
                                            ("gpt_oss", "mlp.router.bias")])
def test_bias_architectures_change_only_router_biases(arch, bias, tmp_path):
    flat = _tensors(make_checkpoint(arch, tmp_path / "flat", **SMALL))
    skewed = _tensors(make_checkpoint(arch, tmp_path / "skewed", router_skew=0.5, **SMALL))
    changed = {name for name in flat if not torch.equal(flat[name], skewed[name])}
    first_moe = 1 if arch == "deepseek_v3" else 0
    assert changed == {f"model.layers.{i}.{bias}" for i in range(first_moe, 3)}


def test_bias_channel_is_written_by_the_embedding_only_and_read_by_the_routers_only(tmp_path):
    seed = 5
    flat = _tensors(make_checkpoint("qwen3_moe", tmp_path / "flat", seed=seed, **SMALL))
    t = _tensors(make_checkpoint("qwen3_moe", tmp_path / "skewed", seed=seed, router_skew=1.0, **SMALL))
    u = shared_direction(64, torch.Generator().manual_seed(seed + SEED_SALT))
    c = SHARED_RATIO * math.sqrt(64)
    torch.testing.assert_close(t["model.embed_tokens.weight"] @ u, torch.full((512,), c))
    for i in range(3):
        p = f"model.layers.{i}."
        for name in ("self_attn.o_proj", *(f"mlp.experts.{e}.down_proj" for e in range(8))):
            assert (u @ t[p + name + ".weight"]).abs().max() < 1e-5, name
        for norm, names in (("input_layernorm", ("q_proj", "k_proj", "v_proj")),
                            ("post_attention_layernorm", ("experts.0.gate_proj", "experts.7.up_proj"))):
            d = t[p + norm + ".weight"] * u
            for name in names:
                w = t[p + ("self_attn." if norm == "input_layernorm" else "mlp.") + name + ".weight"]
                assert (w @ d).abs().max() < 1e-5, name
        d = t[p + "post_attention_layernorm.weight"] * u
        along = (t[p + "mlp.gate.weight"] @ (d / d.norm())).sort(descending=True).values   # the offsets, hottest first
        torch.testing.assert_close(along / along[1], torch.log1p(torch.arange(8.0)) / math.log(2))
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert torch.equal(t[p + name + ".weight"], flat[p + name + ".weight"])


def test_an_unclassified_layer_matrix_is_refused():
    h = 8
    tensors = {"model.embed_tokens.weight": torch.randn(16, h), "model.layers.0.mlp.gate.weight": torch.randn(4, h),
               "model.layers.0.post_attention_layernorm.weight": torch.ones(h),
               "model.layers.0.mlp.fc1.weight": torch.randn(h, h)}
    with pytest.raises(ValueError, match="fc1"):
        apply_router_skew(tensors, "qwen3_moe", 1.0, seed=0, num_experts=4)


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "lots"])
def test_bad_skew_is_refused(bad, tmp_path):
    with pytest.raises(InvalidRequestError, match="router_skew") as e:
        make_checkpoint("qwen3_moe", tmp_path / "out", router_skew=bad, **SMALL)
    assert e.value.field == "router_skew"
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_bad_skew(tmp_path, capsys):
    assert main(["make-checkpoint", "--out", str(tmp_path / "out"), "--router-skew", "nan"]) == 2
    assert "router_skew" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_load_figures():
    load = torch.tensor([[10, 30, 0, 0, 0, 0, 0, 60], [1, 1, 1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(hot_share(load), torch.tensor([0.6, 0.125], dtype=torch.float64))
    torch.testing.assert_close(rank_share(load, ep=2), torch.tensor([0.6, 0.5], dtype=torch.float64))
    torch.testing.assert_close(rank_share(load, ep=4), torch.tensor([0.6, 0.25], dtype=torch.float64))
    with pytest.raises(ValueError, match="ep=3"):
        rank_share(load, ep=3)
