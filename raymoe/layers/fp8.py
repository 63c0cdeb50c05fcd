"""FP8 weights of the linear and expert layers: allocation and sharded reading (``raymoe.config_quant``).

A quantized module keeps its weight as ``float8_e4m3fn`` and a float32 scale grid beside it
(``raymoe.platform.interface.BlockScales``); the platform dequantizes or multiplies in FP8 per call. Block-wise
checkpoints keep their ``[bn, bk]`` grid; per-tensor and per-channel ones load as ``(1, K_local)`` blocks, one scale
per row (a per-tensor scale repeated), so fused parts and TP shards need no special case.

Sharding follows vLLM's block-FP8 rule (``validate_fp8_block_shape``): a TP shard must start on a block boundary
and end on one or at the tensor's end, so its scales are whole rows and columns of the stored grid; otherwise the
load fails naming the tensor. Fused parts (gate/up, q/k/v) whose sizes are not whole row blocks (a Qwen3 k_proj of
64 rows next to 128-row blocks) keep one scale row per weight row instead (``(1, bk)`` resident blocks,
:func:`resident_block`): about ``4 / bk`` bytes more per weight element, where vLLM would misplace the later parts'
scales. Partial edge blocks at a tensor's end are kept as the checkpoint has them.
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.config_quant import Fp8Config
from raymoe.errors import CheckpointError

FP8_DTYPE = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def module_quant(quant: Fp8Config | None, module: str) -> Fp8Config | None:
    """``quant`` where module ``module`` (full dotted name) is stored in FP8, else None (not quantized, or listed in
    ``modules_to_not_convert``)."""
    return quant if quant is not None and quant.quantizes(module) else None


def resident_block(quant: Fp8Config, in_features: int, parts: list[int] | None = None) -> tuple[int, int]:
    """The block of a resident weight with ``in_features`` local columns made of fused parts of ``parts`` rows
    (None: one part): the checkpoint's, ``(1, bk)`` where a part before the last is not whole row blocks, and
    ``(1, K)`` for per-tensor / per-channel scales."""
    if quant.weight_block_size is None:
        return (1, in_features)
    bn, bk = quant.weight_block_size
    if parts and any(p % bn for p in parts[:-1]):
        return (1, bk)
    return (bn, bk)


def fp8_parameters(shape: tuple[int, ...], quant: Fp8Config,
                   parts: list[int] | None = None) -> tuple[nn.Parameter, nn.Parameter, tuple[int, int]]:
    """An empty FP8 weight ``shape`` ([..., N, K]) of fused parts of ``parts`` rows (None: one part), its float32
    scale grid ``[..., ceil(N / bn), ceil(K / bk)]`` and the resident block ``(bn, bk)`` (:func:`resident_block`)."""
    n, k = shape[-2:]
    block = resident_block(quant, k, parts)
    weight = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE), requires_grad=False)
    scale = nn.Parameter(torch.empty(*shape[:-2], _cdiv(n, block[0]), _cdiv(k, block[1]), dtype=torch.float32),
                         requires_grad=False)
    return weight, scale, block


def _check_span(name: str, what: str, start: int, stop: int, full: int, block: int) -> None:
    if start % block or (stop % block and stop != full):
        raise CheckpointError(name, f"the {what} range [{start}, {stop}) of {full} is not on FP8 block boundaries "
                              f"(block {block}): the shard or fused part would split a scale block")


def read_fp8(reader, name: str, quant: Fp8Config, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` and columns ``cols`` (None: all) of the FP8 weight ``name`` (``{module}.weight``) and the
    scales that cover them: (``float8_e4m3fn`` [r, c], float32 ``[ceil(r / bn), ceil(c / bk)]``) in the
    checkpoint's block (per-tensor / per-channel scales become one per row; :func:`rows_of_scales` turns block
    rows into one scale row per weight row).

    Raises:
        CheckpointError: the weight is not stored as ``float8_e4m3fn``; its scale tensor is missing or has a shape
            that does not match the weight and block; or the range is not on block boundaries.
    """
    n, k = reader.shape(name)
    r0, r1 = rows or (0, n)
    c0, c1 = cols or (0, k)
    scale_name = f"{name.rsplit('.', 1)[0]}.{quant.scale_name}"
    if scale_name not in reader:
        raise CheckpointError(scale_name, f"the FP8 weight {name!r} has no {quant.scale_name} tensor")
    stored = reader.get(scale_name).to(torch.float32)
    if quant.weight_block_size is not None:
        bn, bk = quant.weight_block_size
        if tuple(stored.shape) != (_cdiv(n, bn), _cdiv(k, bk)):
            raise CheckpointError(scale_name, f"shape {tuple(stored.shape)} does not match weight {(n, k)} with block "
                                  f"{(bn, bk)} (expected {(_cdiv(n, bn), _cdiv(k, bk))})")
        _check_span(name, "row", r0, r1, n, bn)
        _check_span(name, "column", c0, c1, k, bk)
        scale = stored[r0 // bn:_cdiv(r1, bn), c0 // bk:_cdiv(c1, bk)]
    elif stored.numel() == 1 and stored.dim() <= 1:                     # per-tensor: [] or [1]
        scale = stored.reshape(1, 1).expand(r1 - r0, 1)
    elif tuple(stored.shape) in ((n,), (n, 1)):                        # per-channel: [N] or [N, 1]
        scale = stored.reshape(n, 1)[r0:r1]
    else:
        raise CheckpointError(scale_name, f"shape {tuple(stored.shape)} is neither per-tensor ([] or [1]) nor "
                              f"per-channel ([{n}] or [{n}, 1]) for weight {(n, k)}")
    w = reader.get_slice(name, 0, r0, r1) if (r0, r1) != (0, n) else reader.get(name)
    if w.dtype != FP8_DTYPE:
        raise CheckpointError(name, f"stored as {w.dtype}, but quantization_config says FP8 (float8_e4m3fn) and "
                              "the module is not in modules_to_not_convert")
    return w[:, c0:c1], scale


def rows_of_scales(scale: torch.Tensor, quant: Fp8Config, rows: int, resident: tuple[int, int]) -> torch.Tensor:
    """Scales read by :func:`read_fp8` for ``rows`` weight rows in the resident block: as read, or one row per
    weight row where the resident block has ``bn = 1`` and the checkpoint's has more."""
    bn = quant.weight_block_size[0] if quant.weight_block_size is not None else 1
    if resident[0] == 1 and bn > 1:
        return scale.repeat_interleave(bn, dim=0)[:rows]
    return scale


def copy_fp8_part(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], part: torch.Tensor,
                  part_scale: torch.Tensor, row_offset: int, name: str) -> None:
    """Write one part (a fused part or a shard: ``part`` [r, K_local] FP8 with ``part_scale``) at row
    ``row_offset`` of ``weight`` [N_local, K_local] and its scale grid ``scale``.

    Raises:
        CheckpointError: the part does not start on a row block, or its shape does not fit.
    """
    bn = block[0]
    r = part.shape[0]
    if row_offset % bn or tuple(part.shape) != (r, weight.shape[1]) or row_offset + r > weight.shape[0]:
        raise CheckpointError(name, f"part of shape {tuple(part.shape)} at row {row_offset} does not fit weight "
                              f"{tuple(weight.shape)} with block {block} (fused parts must be whole row blocks)")
    g0 = row_offset // bn
    if g0 + part_scale.shape[0] > scale.shape[0] or part_scale.shape[1] != scale.shape[1]:
        raise CheckpointError(name, f"scales {tuple(part_scale.shape)} at block row {g0} do not fit the grid "
                              f"{tuple(scale.shape)}")
    weight[row_offset:row_offset + r].copy_(part)
    scale[g0:g0 + part_scale.shape[0]].copy_(part_scale)
