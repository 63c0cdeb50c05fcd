"""Trained demo checkpoints (``raymoe.models.train_demo``): training lowers the loss, writes the weights back under
the checkpoint's own names (transformers and raymoe still agree token for token), and gives DeepSeek-V3 one MTP
layer under DeepSeek's names that both ignore for plain decoding."""

from __future__ import annotations

import json

import pytest
from hf_models import greedy_reference
from safetensors import safe_open

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint
from raymoe.models.train_demo import train_checkpoint
from raymoe.models.train_eagle import train_eagle_head

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "vocab_size": 512}
PROMPTS = ["def main():\n", "import os\n", "class Foo:\n    def __init__(self"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_training_lowers_the_loss_and_keeps_parity(tmp_path, arch):
    path = make_checkpoint(arch, tmp_path / arch, seed=2, **DIMS)
    report = train_checkpoint(path, 0.0, steps=40, seq_len=32, batch_size=4, progress=False, log_every=5,
                              mtp_distill_steps=30 if arch == "deepseek_v3" else 0, mtp_distill_pool=16)
    assert report.steps == 40 and report.tokens == 40 * 4 * 32
    assert report.final_loss < report.losses[0][1] - 1.0, report.losses
    log = json.loads((path / "train_log.json").read_text())
    assert log["final_loss"] == pytest.approx(report.final_loss) and len(log["losses"]) >= 8
    cfg = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    if arch == "deepseek_v3":
        assert cfg["num_nextn_predict_layers"] == 1 and report.final_mtp_loss is not None
        # the distillation makes the layer's drafts agree more often with what the model writes greedily
        before, after = report.draft_agreement
        assert report.distill_steps == 30 and 0.0 <= before < after <= 1.0, report.draft_agreement
        assert log["draft_agreement"] == [before, after]
        for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight",
                     "shared_head.norm.weight", "shared_head.head.weight", "self_attn.kv_a_proj_with_mqa.weight",
                     "mlp.experts.0.gate_proj.weight", "mlp.gate.weight", "input_layernorm.weight"):
            assert mtp + leaf in names, leaf
    else:
        assert not any(n.startswith(mtp) for n in names) and report.draft_agreement is None
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with Engine(str(path)) as e:
        ours = [o.token_ids for o in e.generate(PROMPTS, params)]
    assert ours == greedy_reference(str(path), PROMPTS, 12)
    if arch == "qwen3_moe":  # an EAGLE head for it, distilled on its greedy text the same way
        head = train_eagle_head(path, tmp_path / "head", 0.0, steps=20, seq_len=32, batch_size=4, progress=False,
                                distill_steps=30, distill_pool=16)
        before, after = head.draft_agreement
        assert head.distill_steps == 30 and 0.0 <= before < after <= 1.0, head.draft_agreement
        assert (tmp_path / "head" / "model.safetensors").is_file()


def test_training_refuses_what_it_cannot_train(tmp_path):
    path = make_checkpoint("gpt_oss", tmp_path / "g", seed=1, **DIMS)
    with pytest.raises(ValueError, match="not supported"):
        train_checkpoint(path, 1.0, progress=False)
    path = make_checkpoint("qwen3_moe", tmp_path / "q", seed=1, **DIMS)
    with pytest.raises(ValueError, match="seconds > 0"):
        train_checkpoint(path, 0.0, progress=False)


def test_a_step_with_a_non_finite_loss_is_skipped():
    import torch

    from raymoe.models.train_demo import TrainLoop

    w = torch.nn.Parameter(torch.ones(3))
    loop = TrainLoop("t", 0.0, 2, 0.1, [w], 3, 1, progress=False)
    assert loop.next()
    loop.step((w * float("nan")).sum(), float("nan"))
    assert torch.equal(w.detach(), torch.ones(3)) and loop.report.skipped_steps == 1
    assert loop.next()
    loop.step((w * w).sum(), 3.0)
    assert not torch.equal(w.detach(), torch.ones(3)) and not loop.next()
    assert loop.finish().final_loss == 3.0


def test_the_mtp_layer_starts_from_seeded_finite_weights(tmp_path):
    """transformers leaves the fused expert tensors uninitialized outside ``from_pretrained``: the MTP layer draws
    them itself, so one seed gives one layer (reused memory once made every training step non-finite)."""
    import torch
    from transformers import AutoConfig

    from raymoe.models.train_demo import MTPLayer

    cfg = AutoConfig.from_pretrained(str(make_checkpoint("deepseek_v3", tmp_path / "d", seed=2, **DIMS)))
    head = torch.nn.Linear(DIMS["hidden_size"], DIMS["vocab_size"], bias=False)
    layers = []
    for _ in range(2):
        torch.manual_seed(7)
        garbage = torch.full((1 << 16,), float("nan"))  # freed memory the next allocations may be handed
        del garbage
        layers.append(MTPLayer(cfg, DIMS["num_layers"], head).state_dict())
    for name, tensor in layers[0].items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, layers[1][name]), name
