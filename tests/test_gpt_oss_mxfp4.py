"""gpt-oss MXFP4 expert checkpoints: the dequantization against transformers' own
(``integrations.mxfp4.convert_moe_packed_tensors``), the quantizer's round trip, greedy parity of a
``make-checkpoint --arch gpt_oss --mxfp4`` folder against transformers loading the same folder (it dequantizes on
CPU), and refusal by name of what is not understood."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from raymoe import Engine, SamplingParams
from raymoe.errors import CheckpointError
from raymoe.models.checkpoint import make_checkpoint
from raymoe.models.mxfp4 import FP4_E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "vocab_size": 512, "sliding_window": 6}
PROMPTS = ["def fib(n):\n    return n if n < 2 else", "import os\nimport sys\n\n", "The quick brown fox jumps"]


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    return str(make_checkpoint("gpt_oss", tmp_path_factory.mktemp("mx") / "gpt_oss_mxfp4", seed=4, mxfp4=True,
                               **DIMS))


def test_dequantize_matches_transformers(mxfp4_folder):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with safe_open(f"{mxfp4_folder}/model.safetensors", "pt") as f:
        for proj in ("gate_up_proj", "down_proj"):
            blocks = f.get_tensor(f"model.layers.1.mlp.experts.{proj}_blocks")
            scales = f.get_tensor(f"model.layers.1.mlp.experts.{proj}_scales")
            ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32, proj), ref)
            assert ref.abs().max() > 0


def test_quantize_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 64, 5, generator=g)                                     # [E, K, R]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    back = dequantize_mxfp4(blocks, scales, torch.float32, "w")
    # each value within half an FP4 step (at most 1.0 at the top of the range) times its block's scale
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1).transpose(-1, -2)
    assert ((back - w).abs() <= step + 1e-6).all()
    exact = torch.tensor(FP4_E2M1_VALUES).repeat(4).view(1, 64, 1) * 0.25      # representable: exact
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact), torch.float32, "x"), exact)


def test_mxfp4_checkpoint_greedy_matches_transformers(mxfp4_folder):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = AutoModelForCausalLM.from_pretrained(mxfp4_folder, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    params = SamplingParams(max_tokens=16, temperature=0.0)
    with Engine(mxfp4_folder, max_context_len=128, max_running_requests=4) as e:
        outs = e.generate(PROMPTS, params)
        ids = [e.encode(p) for p in PROMPTS]
    for prompt_ids, out in zip(ids, outs, strict=True):
        x = torch.tensor([prompt_ids])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False)
        assert out.token_ids == ref[0, len(prompt_ids):].tolist()


def _copy_with(folder: str, dst, config_update=None, tensors_update=None, drop=()):
    shutil.copytree(folder, dst)
    if config_update:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_update)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors_update or drop:
        t = load_file(str(dst / "model.safetensors"))
        for name in drop:
            del t[name]
        t.update(tensors_update or {})
        save_file(t, str(dst / "model.safetensors"))
    return str(dst)


def test_not_understood_is_refused_by_name(mxfp4_folder, tmp_path):
    from raymoe.config import ModelConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig

    fp8 = _copy_with(mxfp4_folder, tmp_path / "fp8", {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(CheckpointError, match="quant_method 'fp8'"):
        ModelConfig.from_hf(fp8)

    def load(folder):
        return ModelRunner(RunnerConfig(folder, "float32", num_kv_slots=64, max_req_rows=2, max_context_len=64))

    odd = _copy_with(mxfp4_folder, tmp_path / "odd", tensors_update={
        "model.layers.0.self_attn.o_proj_blocks": torch.zeros(64, 2, 16, dtype=torch.uint8)})
    with pytest.raises(CheckpointError, match="o_proj_blocks"):
        load(odd)
    missing = _copy_with(mxfp4_folder, tmp_path / "missing", drop=["model.layers.1.mlp.experts.down_proj_scales"])
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        load(missing)
