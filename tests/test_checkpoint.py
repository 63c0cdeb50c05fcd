"""Seeded tiny checkpoints, the trained tokenizer and CheckpointReader, checked against transformers."""

from __future__ import annotations

import json
import statistics
import threading
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from raymoe.config import ModelConfig
from raymoe.errors import CheckpointError, InvalidRequestError
from raymoe.models import checkpoint as ckpt_mod
from raymoe.models.checkpoint import default_model_path, make_checkpoint
from raymoe.models.loader import INDEX_FILE, CheckpointReader
from raymoe.models.tokenizer_builder import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    build_tokenizer,
    train_tokenizer,
)

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "import os\nimport sys\n\nclass Config:\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé: 日本語のテキスト and emoji 🙂",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ck") / "tiny", seed=0)


@pytest.fixture(scope="module")
def hf_loaded(ckpt: Path):
    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def hf_tok(ckpt: Path):
    return transformers.AutoTokenizer.from_pretrained(ckpt)


def _assert_clean_load(info: dict) -> None:
    print("transformers loading info:", info)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    assert not info.get("error_msgs"), info


# ---------------------------------------------------------------------------------------------- transformers


def test_transformers_loads_every_weight(hf_loaded, ckpt: Path):
    model, info = hf_loaded
    _assert_clean_load(info)
    assert isinstance(model.config, transformers.Qwen3MoeConfig)
    assert model.config.eos_token_id == IM_END_ID
    assert model.generation_config.eos_token_id == [IM_END_ID, ENDOFTEXT_ID]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    cfg = ModelConfig.from_hf(ckpt)
    assert cfg.model_type == "qwen3_moe" and cfg.eos_token_ids == (IM_END_ID, ENDOFTEXT_ID)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}


def test_expert_weights_map_to_fused_tensors(hf_loaded, ckpt: Path):
    model, _ = hf_loaded
    disk = load_file(str(ckpt / "model.safetensors"))
    hf = dict(model.named_parameters())
    for layer, e in [(0, 0), (1, 3), (3, 7)]:
        p = f"model.layers.{layer}.mlp."
        gate, up = disk[f"{p}experts.{e}.gate_proj.weight"], disk[f"{p}experts.{e}.up_proj.weight"]
        assert torch.equal(hf[p + "experts.gate_up_proj"][e], torch.cat([gate, up], dim=0))
        assert torch.equal(hf[p + "experts.down_proj"][e], disk[f"{p}experts.{e}.down_proj.weight"])
        assert torch.equal(hf[p + "gate.weight"], disk[p + "gate.weight"])
    for name in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.2.self_attn.k_norm.weight"]:
        assert torch.equal(hf[name], disk[name])
    # every on-disk tensor that transformers keeps unfused is loaded unchanged (no random init left)
    for name, t in disk.items():
        if ".experts." not in name:
            assert torch.equal(hf[name], t), name


def test_dense_layers_and_tied_embeddings_load(tmp_path: Path):
    path = make_checkpoint(
        "qwen3_moe", tmp_path / "dense", num_layers=4, decoder_sparse_step=2, mlp_only_layers=(1,),
        tie_word_embeddings=True, num_experts=4, num_experts_per_tok=1,
    )
    with CheckpointReader(path) as r:
        assert "lm_head.weight" not in r
        assert r.shape("model.layers.0.mlp.gate_proj.weight") == (256, 128)
        assert "model.layers.1.mlp.down_proj.weight" in r and "model.layers.1.mlp.gate.weight" not in r
        assert "model.layers.2.mlp.up_proj.weight" in r  # (2 + 1) % 2 != 0: dense
        assert r.shape("model.layers.3.mlp.experts.3.down_proj.weight") == (128, 64)
        assert r.shape("model.layers.3.mlp.gate.weight") == (4, 128)
    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    _assert_clean_load(info)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_unknown_arch_and_bad_sizes_rejected(tmp_path: Path):
    with pytest.raises(InvalidRequestError) as e:
        make_checkpoint("gpt2", tmp_path / "x")
    assert e.value.field == "arch"
    with pytest.raises(InvalidRequestError):
        make_checkpoint("qwen3_moe", tmp_path / "x", num_heads=4, num_kv_heads=3)
    assert not (tmp_path / "x").exists()


def test_logits_are_well_separated(hf_loaded, hf_tok):
    model, _ = hf_loaded
    gaps: list[float] = []
    stds: list[float] = []
    router_gaps: list[float] = []
    k = model.config.num_experts_per_tok

    def on_router(_mod, _inp, out):
        top = out[0].topk(k + 1, dim=-1).values  # router logits [tokens, experts]
        router_gaps.extend((top[:, k - 1] - top[:, k]).tolist())

    hooks = [layer.mlp.gate.register_forward_hook(on_router) for layer in model.model.layers]
    try:
        with torch.no_grad():
            for prompt in PROMPTS:
                logits = model(hf_tok(prompt, return_tensors="pt").input_ids).logits[0]
                top2 = logits.topk(2, dim=-1).values
                gaps.extend((top2[:, 0] - top2[:, 1]).tolist())
                stds.append(logits.std(dim=-1).mean().item())
    finally:
        for h in hooks:
            h.remove()
    median_gap = statistics.median(gaps)
    print(f"logits: median top1-top2 gap {median_gap:.3f} (min {min(gaps):.4f}, n={len(gaps)}), "
          f"mean std {statistics.mean(stds):.2f}; router: median k/k+1 gap {statistics.median(router_gaps):.3f}")
    assert median_gap > 0.05
    assert 3.0 < statistics.mean(stds) < 12.0
    assert statistics.median(router_gaps) > 0.05


def test_greedy_generation_is_not_one_repeated_token(hf_loaded, hf_tok):
    model, _ = hf_loaded
    ids = hf_tok(PROMPTS[0], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert len(set(out.tolist())) > 4


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_loads_with_special_tokens(hf_tok):
    assert len(hf_tok) == 2048
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.eos_token_id == IM_END_ID
    assert hf_tok.pad_token == "<|endoftext|>" and hf_tok.pad_token_id == ENDOFTEXT_ID
    assert hf_tok.bos_token is None
    assert hf_tok.convert_tokens_to_ids("<|im_start|>") == IM_START_ID
    assert hf_tok.encode("<|im_start|>user", add_special_tokens=True)[0] == IM_START_ID


def test_chat_template_renders_chatml(hf_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]


@pytest.mark.parametrize("text", [
    "def f(x: int) -> int:\n\treturn x ** 2  # square\n\n\nprint(f(3), {'a': [1, 2]})\n",
    "Grüße, naïve café — 日本語, Ελληνικά, русский, 🙂🚀 and \u00a0nbsp\r\n",
    "  leading spaces and trailing  ",
])
def test_encode_decode_round_trip(hf_tok, text: str):
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert max(ids) < 2048
    assert hf_tok.decode(ids) == text


def test_python_source_compresses(hf_tok):
    snippet = "import os\n\ndef main():\n    for name in sorted(os.listdir('.')):\n        print(name)\n"
    assert len(hf_tok.encode(snippet)) < len(snippet) / 2


def test_tokenizer_training_is_deterministic(tmp_path: Path):
    assert train_tokenizer(1024).to_str() == train_tokenizer(1024).to_str()
    build_tokenizer(tmp_path / "a", vocab_size=1024)
    build_tokenizer(tmp_path / "b", vocab_size=1024)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    with pytest.raises(InvalidRequestError):
        train_tokenizer(100)


# ---------------------------------------------------------------------------------------------- determinism


def test_same_seed_same_bytes_other_seed_differs(ckpt: Path, tmp_path: Path):
    again = make_checkpoint("qwen3_moe", tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load_file(str(make_checkpoint("qwen3_moe", tmp_path / "other", seed=1) / "model.safetensors"))
    assert other.keys() == a.keys()
    assert not torch.equal(other["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert not torch.equal(other["model.layers.3.mlp.experts.5.up_proj.weight"],
                           a["model.layers.3.mlp.experts.5.up_proj.weight"])


def test_rebuild_replaces_existing_folder(tmp_path: Path):
    out = tmp_path / "m"
    make_checkpoint("qwen3_moe", out, seed=0, num_layers=1)
    make_checkpoint("qwen3_moe", out, seed=0, num_layers=2)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp folders left behind


# ---------------------------------------------------------------------------------------------- sharding


def test_sharded_build_matches_single_file(ckpt: Path, tmp_path: Path):
    sharded = make_checkpoint("qwen3_moe", tmp_path / "sharded", seed=0, max_shard_bytes=1_000_000)
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    with CheckpointReader(ckpt) as single, CheckpointReader(sharded) as multi:
        assert single.names() == multi.names() == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(single.get(n).nbytes for n in single.names())
        for name in single.names():
            assert torch.equal(single.get(name), multi.get(name)), name
    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        sharded, dtype=torch.float32, output_loading_info=True
    )
    _assert_clean_load(info)
    disk = load_file(str(ckpt / "model.safetensors"))
    down = disk["model.layers.2.mlp.experts.4.down_proj.weight"]
    assert torch.equal(model.model.layers[2].mlp.experts.down_proj[4], down)


# ---------------------------------------------------------------------------------------------- reader


def test_reader_get_and_slices(ckpt: Path):
    with CheckpointReader(ckpt) as r:
        assert "model.norm.weight" in r and "nope" not in r
        q = "model.layers.1.self_attn.q_proj.weight"
        full = r.get(q)
        assert full.dtype == torch.float32 and r.shape(q) == tuple(full.shape) == (128, 128)
        assert torch.equal(r.get_slice(q, 0, 32, 64), full[32:64])
        assert torch.equal(r.get_slice(q, 1, 16, 48), full[:, 16:48])
        assert torch.equal(r.get_slice(q, -1, 0, 128), full)
        assert r.get_slice(q, 0, 5, 5).shape == (0, 128)
        assert r.get(q, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert r.get_slice(q, 0, 0, 8, dtype=torch.float16).dtype == torch.float16
        with pytest.raises(InvalidRequestError):
            r.get_slice(q, 2, 0, 1)
        with pytest.raises(InvalidRequestError):
            r.get_slice(q, 0, 100, 200)
    assert torch.equal(r.get(q), full)  # reopens after close


def test_reader_missing_tensor_is_named(ckpt: Path):
    with CheckpointReader(ckpt) as r:
        for call in (lambda: r.get("model.layers.9.mlp.gate.weight"),
                     lambda: r.get_slice("model.layers.9.mlp.gate.weight", 0, 0, 1),
                     lambda: r.shape("model.layers.9.mlp.gate.weight")):
            with pytest.raises(CheckpointError, match=r"model\.layers\.9\.mlp\.gate\.weight"):
                call()


def test_reader_missing_folder_and_no_weights(tmp_path: Path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        CheckpointReader(tmp_path / "empty")


@pytest.mark.parametrize("cut", [0.5, 0.0001, 0.0])
def test_reader_truncated_file_names_the_file(ckpt: Path, tmp_path: Path, cut: float):
    broken = tmp_path / "broken"
    broken.mkdir()
    data = (ckpt / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(broken)
    assert e.value.path.endswith("model.safetensors")
    assert "model.safetensors" in str(e.value)


def test_reader_sharded_errors(tmp_path: Path):
    sharded = make_checkpoint("qwen3_moe", tmp_path / "s", num_layers=2, max_shard_bytes=500_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    last = shards[-1]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=last.name):
        CheckpointReader(sharded)
    last.unlink()
    with pytest.raises(CheckpointError, match=f"{last.name}: safetensors file is missing"):
        CheckpointReader(sharded)
    (sharded / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=INDEX_FILE):
        CheckpointReader(sharded)


# ---------------------------------------------------------------------------------------------- default path


def test_default_model_path_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RAYMOE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []
    real = ckpt_mod.make_checkpoint

    def counting(arch, out, **kw):
        calls.append(Path(out))
        return real(arch, out, num_layers=1, **{k: v for k, v in kw.items() if k != "num_layers"})

    monkeypatch.setattr(ckpt_mod, "make_checkpoint", counting)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_path(progress=False))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    path = results[0]
    assert path.parent == tmp_path / "cache" and path.name.startswith("demo-qwen3_moe-v")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert default_model_path(progress=False) == path and len(calls) == 1
