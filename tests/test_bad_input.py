"""Bad input gives typed errors that name the field (never a hang or a crash)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raymoe import CheckpointError, Engine, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    with Engine(tiny_model, max_context_len=64) as e:
        yield e


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate("")
    assert ei.value.field == "prompt"
    with pytest.raises(InvalidRequestError):
        engine.generate(prompt_token_ids=[[]])


def test_prompt_longer_than_context(engine):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(prompt_token_ids=[[5] * 100])
    assert ei.value.field == "prompt"
    # The engine still serves afterwards and nothing leaked from the refused request.
    assert len(engine.generate("ok", SamplingParams(max_tokens=3, temperature=0))[0].token_ids) >= 1


def test_out_of_vocab_token(engine):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(prompt_token_ids=[[1, 10**6]])
    assert ei.value.field == "prompt"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2.0}, "min_p"),
    ({"top_k": -5}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"min_p": -1e-9}, "min_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop": ["a"] * 257}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["\ud800"]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": 7}, "stop_token_ids"),
])
def test_sampling_params_out_of_range(kwargs, field):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kwargs)
    assert ei.value.field == field


def test_sampling_params_at_their_bounds_are_accepted():
    import numpy as np

    from raymoe.scheduler.sampling_params import MAX_SEED, MAX_TOKENS, MAX_TOP_K

    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, top_k=MAX_TOP_K, min_p=1.0, seed=MAX_SEED,
                       stop=["x" * 1024] * 256, stop_token_ids=[np.int64(2**31 - 1)] * 1024, logprobs=20)
    assert p.stop_token_ids[0] == 2**31 - 1 and isinstance(p.stop, tuple)
    assert SamplingParams(stop="abc").stop == ("abc",)


def test_wrong_number_of_sampling_params(engine):
    with pytest.raises(InvalidRequestError) as ei:
        engine.generate(["a", "b"], [SamplingParams()])
    assert ei.value.field == "sampling_params"


def test_unknown_engine_option(tiny_model):
    with pytest.raises(InvalidRequestError) as ei:
        Engine(tiny_model, max_tokenz=3)
    assert ei.value.field == "max_tokenz"


def test_missing_model_folder(tmp_path):
    with pytest.raises(CheckpointError):
        Engine(tmp_path / "nope")


def test_truncated_safetensors(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as ei:
        Engine(broken)
    assert "model.safetensors" in str(ei.value)


def test_missing_tensor_is_named(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "missing"
    shutil.copytree(tiny_model, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError) as ei:
        Engine(broken)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in str(ei.value)


def test_cli_generate_prints_text(tmp_path):
    env = {"RAYMOE_CACHE_DIR": str(tmp_path / "cache"), "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run([sys.executable, "-m", "raymoe.cli", "generate", "--prompt", "def fib(n):"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def fib(n):")
    assert len(proc.stdout.strip()) > len("def fib(n):")
