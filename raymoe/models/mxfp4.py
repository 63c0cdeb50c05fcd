"""MXFP4 expert weights as gpt-oss checkpoints ship them, dequantized on the host at load.

Format (OCP Microscaling Formats v1.0, MXFP4; the layout of openai/gpt-oss's checkpoints, read the same way by
transformers' ``integrations.mxfp4.convert_moe_packed_tensors``): a quantized expert projection ``P`` of logical
shape [E, R, K] is stored as ``P_blocks`` uint8 [E, R, K / 32, 16] (two FP4 E2M1 codes per byte, the low nibble
first) and ``P_scales`` uint8 [E, R, K / 32] (E8M0: the block's power of two plus 127). Value
``FP4[code] * 2 ** (scale - 127)``; the dequantized [E, R, K] is transposed to transformers' unquantized layout
[E, K, R] (``gate_up_proj`` [E, H, 2 I], ``down_proj`` [E, I, H]).

No GPU MXFP4 kernel is used: every platform gets the dequantized weights in the model's dtype.
"""

from __future__ import annotations

import re

import torch

from raymoe.errors import CheckpointError

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 E2M1 values, indexed by code."""
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``blocks`` uint8 [..., R, G, 16] and ``scales`` uint8 [..., R, G] -> [..., G * 32, R] in ``dtype``
    (module docstring; exact in float32 and bfloat16 for scales within their exponent range). Dequantized one
    leading index (an expert) at a time, so the float32 intermediates stay the size of one expert's projection.

    Raises:
        CheckpointError: (naming ``name``) wrong dtypes or shapes.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(name, f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(name, f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                                    "(expected [..., R, G, 16] and [..., R, G])")
    *lead, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, rows, groups, 16), scales.reshape(-1, rows, groups)
    out = torch.empty(flat_blocks.shape[0], groups * 32, rows, dtype=dtype)
    for i in range(flat_blocks.shape[0]):
        b = flat_blocks[i]
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).long()                      # [R, G, 16, 2]
        values = lut[codes].flatten(-3)                                              # [R, G * 32]
        exps = (flat_scales[i].to(torch.int32) - 127).repeat_interleave(32, dim=-1)  # [R, G * 32]
        out[i] = torch.ldexp(values, exps.float()).t()
    return out.reshape(*lead, groups * 32, rows)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse layout of :func:`dequantize_mxfp4`, for building checkpoints: ``w`` [..., K, R] (K a multiple
    of 32) -> ``(blocks`` uint8 [..., R, K / 32, 16], ``scales`` uint8 [..., R, K / 32]``)``. Each block of 32
    values gets the smallest power of two that brings its largest magnitude to at most 6 (the largest FP4 value);
    values round to the nearest FP4 value (ties to the lower code).

    Raises:
        ValueError: K is not a multiple of 32.
    """
    k, r = w.shape[-2], w.shape[-1]
    if k % 32:
        raise ValueError(f"MXFP4 blocks need the reduced dim to be a multiple of 32, got {k}")
    x = w.float().transpose(-1, -2).reshape(*w.shape[:-2], r, k // 32, 32)           # [..., R, G, 32]
    amax = x.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)                        # [..., R, G]
    lut = torch.tensor(FP4_E2M1_VALUES[:8])
    scaled = (x / torch.exp2(exp).unsqueeze(-1)).abs()
    mag = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1)                           # [..., R, G, 32] in [0, 8)
    codes = (mag + 8 * (x < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


class Mxfp4Experts:
    """A checkpoint reader view answering ``...mlp.experts.gate_up_proj`` / ``down_proj`` from their MXFP4
    ``_blocks`` / ``_scales`` when the checkpoint holds those (expert slices along dim 0 dequantize only the slice);
    every other name passes through.

    Args:
        reader: a ``CheckpointReader`` (``get``, ``get_slice``, ``shape``, ``names``).

    Raises:
        CheckpointError: a quantized tensor other than an expert projection's blocks and scales (named).
    """

    def __init__(self, reader):
        self.reader = reader
        names = reader.names() if callable(getattr(reader, "names", None)) else set()
        for n in sorted(names):
            if (n.endswith("_blocks") or n.endswith("_scales")) and not _QUANTIZED.match(n):
                raise CheckpointError(n, "quantized tensor not understood (MXFP4 is read for the experts' "
                                         "gate_up_proj and down_proj only)")
        self.quantized = {n.rsplit("_", 1)[0] for n in names if _QUANTIZED.match(n)}

    def _check_pair(self, name: str) -> None:
        for part in ("blocks", "scales"):
            if f"{name}_{part}" not in self.reader:
                raise CheckpointError(f"{name}_{part}", "missing: MXFP4 weights need both blocks and scales")

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.quantized:
            return self.reader.get(name, dtype=dtype)
        self._check_pair(name)
        return dequantize_mxfp4(self.reader.get(f"{name}_blocks"), self.reader.get(f"{name}_scales"),
                                dtype or torch.bfloat16, name)

    def get_slice(self, name: str, dim: int, start: int, end: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``[start, end)`` along ``dim``; a quantized projection slices its experts only (dim 0).

        Raises:
            CheckpointError: a slice of a quantized projection along another dim.
        """
        if name not in self.quantized:
            return self.reader.get_slice(name, dim, start, end, dtype=dtype)
        if dim != 0:
            raise CheckpointError(name, f"MXFP4 projections are read per expert (dim 0), not along dim {dim}")
        self._check_pair(name)
        return dequantize_mxfp4(self.reader.get_slice(f"{name}_blocks", 0, start, end),
                                self.reader.get_slice(f"{name}_scales", 0, start, end), dtype or torch.bfloat16, name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return self.reader.shape(name)
        *lead, rows, groups, _ = self.reader.shape(f"{name}_blocks")
        return (*lead, groups * 32, rows)
