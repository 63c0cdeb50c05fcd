"""Writing FP8 checkpoints (``raymoe make-checkpoint --quant fp8``) in the Hugging Face layout DeepSeek-V3 and Qwen3
FP8 ship: every projection weight (``*_proj.weight``, Mixtral's ``experts.E.w1/w2/w3.weight``) not listed in
``modules_to_not_convert`` becomes ``float8_e4m3fn`` with a float32 scale, and ``config.json`` gets the
``quantization_config`` (``raymoe.config_quant``). Embeddings, norms, router gates and the LM head stay as they are.

Quantization (the inverse of the loaders' dequantization ``w = fp8 * scale``): block-wise, each ``[bn, bk]`` block
(partial edge blocks included) gets ``scale = amax(|w|) / 448`` (DeepSeek's ``act_quant`` / ``weight_quant`` rule;
1 for an all-zero block) and ``fp8 = cast(w / scale)``, stored as ``weight_scale_inv`` ``[ceil(N / bn),
ceil(K / bk)]``; per-tensor one scale ``weight_scale`` of shape ``[]``; per-channel ``weight_scale`` ``[N, 1]``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from raymoe.config_quant import FP8_MAX, Fp8Config

FP8_SCHEMES = ("block", "tensor", "channel")
_QUANTIZED = re.compile(r"^(.*(?:_proj|_proj_with_mqa|\.experts\.\d+\.w[123]))\.weight$")


def quantized_module(name: str) -> str | None:
    """The module of tensor ``name`` when the FP8 writer quantizes that kind of tensor (projections, Mixtral's
    expert ``w1/w2/w3``), else None."""
    m = _QUANTIZED.match(name)
    return m.group(1) if m else None


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_weight(w: torch.Tensor, scheme: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] (any float dtype) -> (``float8_e4m3fn`` [N, K], float32 scale: ``[ceil(N / bn), ceil(K / bk)]``
    for ``"block"``, ``[]`` for ``"tensor"``, ``[N, 1]`` for ``"channel"``); see the module docstring.

    Raises:
        ValueError: an unknown scheme, a block scheme without ``block``, or ``w`` not 2-D.
    """
    if w.dim() != 2:
        raise ValueError(f"FP8 weights are [N, K], got {tuple(w.shape)}")
    w = w.to(torch.float32)
    n, k = w.shape
    if scheme == "tensor":
        scale = _scale_of(w.abs().amax())
        expanded = scale
    elif scheme == "channel":
        scale = _scale_of(w.abs().amax(dim=1, keepdim=True))
        expanded = scale
    elif scheme == "block" and block is not None:
        bn, bk = block
        gn, gk = -(-n // bn), -(-k // bk)
        padded = torch.zeros(gn * bn, gk * bk)
        padded[:n, :k] = w.abs()
        scale = _scale_of(padded.view(gn, bn, gk, bk).amax(dim=(1, 3)))
        expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        raise ValueError(f"unknown FP8 scheme {scheme!r} (block needs a block size); known: {FP8_SCHEMES}")
    q = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float32).contiguous()


def fp8_config(scheme: str, block: tuple[int, int] | None, modules_to_not_convert: tuple[str, ...] = ()) -> Fp8Config:
    """The :class:`Fp8Config` a checkpoint written with ``scheme`` carries (block size only for ``"block"``).

    Raises:
        ValueError: an unknown scheme.
    """
    if scheme not in FP8_SCHEMES:
        raise ValueError(f"unknown FP8 scheme {scheme!r}; known: {FP8_SCHEMES}")
    return Fp8Config(weight_block_size=tuple(block) if scheme == "block" else None,
                     modules_to_not_convert=tuple(modules_to_not_convert))


def quantize_tensors(tensors: dict[str, torch.Tensor], quant: Fp8Config, scheme: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every quantizable weight (:func:`quantized_module`, not excluded by
    ``quant.modules_to_not_convert``) replaced by its FP8 weight and scale (``quant.scale_name``), in order."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = quantized_module(name)
        if module is None or t.dim() != 2 or not quant.quantizes(module):
            out[name] = t
            continue
        q, s = quantize_weight(t, scheme, quant.weight_block_size)
        out[name] = q
        out[f"{module}.{quant.scale_name}"] = s
    return out


def quantize_folder(src: str | Path, dst: str | Path, scheme: str = "block", block: tuple[int, int] | None = (128, 128),
                    modules_to_not_convert: tuple[str, ...] = ()) -> Path:
    """Write an FP8 copy of the unquantized Hugging Face folder ``src`` at ``dst``: one ``model.safetensors``
    (:func:`quantize_tensors`), ``config.json`` with ``quantization_config``, every other file copied.

    Raises:
        ValueError: ``src`` already has a ``quantization_config``, or an unknown scheme.
    """
    from safetensors import safe_open

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config") is not None:
        raise ValueError(f"{src} is already quantized")
    quant = fp8_config(scheme, block, modules_to_not_convert)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    save_file(quantize_tensors(tensors, quant, scheme), str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant.to_hf()}, indent=2) + "\n")
    return dst
