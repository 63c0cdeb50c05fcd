"""The fp32 twin of an FP8 checkpoint folder, dequantized with the reference semantics (weight ``[i, j]`` = fp8
``[i, j]`` * scale ``[i // bn, j // bk]``, partial edge blocks included), for oracle tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def dequantized_twin(src: Path, dst: Path) -> Path:
    """The fp32 twin of FP8 folder ``src``: every FP8 weight times its block's scale, element by element in index
    arithmetic, and no ``quantization_config``."""
    config = json.loads((src / "config.json").read_text())
    bn, bk = config.pop("quantization_config")["weight_block_size"]
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(config))
    out = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.endswith(".weight_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                scale = f.get_tensor(name + "_scale_inv")
                rows, cols = torch.arange(t.shape[0]) // bn, torch.arange(t.shape[1]) // bk
                t = t.to(torch.float32) * scale[rows[:, None], cols[None, :]]
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    return dst
