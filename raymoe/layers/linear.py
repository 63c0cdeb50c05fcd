"""Tensor-parallel linear layers (Megatron-LM style, Shoeybi et al. 2019).

Shard arithmetic happens in the constructors (``local`` vs ``full`` sizes); collectives happen only in
``forward``, through the explicit ``ParallelGroups`` handle. Weights are ``[out_features, in_features]`` as in
``torch.nn.Linear`` and Hugging Face checkpoints; each rank reads only its own slice from the checkpoint. The
multiplication is the rank's platform's (``Platform.linear``), over the weight and what the platform prepared of it
once the layer was loaded (``prepared``: a packed copy on a CPU rank).

A layer built with ``quant`` (an ``Fp8Config``: its module is stored in FP8) holds ``weight`` as ``float8_e4m3fn``
with ``weight_scale`` (float32 block grid, ``raymoe.layers.fp8``) and reads the checkpoint's FP8 tensors and scales
for its own rows and columns only; the platform multiplies over both.
"""

from __future__ import annotations

import torch
from torch import nn

from raymoe.comm.groups import ParallelGroups, divide, tp_all_gather_last_dim, tp_all_reduce
from raymoe.config_quant import Fp8Config
from raymoe.errors import CheckpointError
from raymoe.layers.fp8 import copy_fp8_part, fp8_parameters, read_fp8, rows_of_scales
from raymoe.platform.interface import BlockScales, Platform, WeightKind


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise CheckpointError(name, f"shape {tuple(tensor.shape)} does not match the model's {tuple(expected)}")


class _PlatformLinear(nn.Module):
    """What every linear layer here shares: its platform, its weight (FP8 with scales when ``quant`` is set) and
    the weight's prepared form, the multiplication."""

    def __init__(self, ops: Platform, out_features: int, in_features: int, dtype: torch.dtype,
                 quant: Fp8Config | None, parts: list[int] | None = None):
        super().__init__()
        self.ops = ops
        self.prepared = None
        self.quant = quant
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            self.weight_scale, self.block = None, None
        else:
            self.weight, self.weight_scale, self.block = fp8_parameters((out_features, in_features), quant, parts)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.prepared, bias)

    def prepare(self) -> None:
        """Let the platform prepare the loaded weight (after every load)."""
        scales = None if self.quant is None else BlockScales(self.weight_scale.data, self.block)
        self.prepared = self.ops.prepare_weight(self.weight, WeightKind.LINEAR, scales)

    def weight_values(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values [out_local, in_local] in ``dtype`` (dequantized where it is FP8)."""
        return self.ops.weight_values(self.weight, self.prepared, dtype)

    def _read_into(self, reader, name: str, rows: tuple[int, int], cols: tuple[int, int] | None,
                   row_offset: int) -> None:
        """Copy rows ``rows`` (and columns ``cols``, None: all) of checkpoint tensor ``name`` into local rows from
        ``row_offset`` (with their scales for an FP8 layer)."""
        if self.quant is not None:
            w, s = read_fp8(reader, name, self.quant, rows, cols)
            s = rows_of_scales(s, self.quant, w.shape[0], self.block)
            copy_fp8_part(self.weight.data, self.weight_scale.data, self.block, w, s, row_offset, name)
            return
        if cols is None:
            w = reader.get_slice(name, 0, rows[0], rows[1], dtype=self.weight.dtype)
        else:
            w = reader.get_slice(name, 1, cols[0], cols[1], dtype=self.weight.dtype)[rows[0]:rows[1]]
        n = rows[1] - rows[0]
        _check_shape(name, w, (n, self.weight.shape[1]))
        self.weight.data[row_offset:row_offset + n].copy_(w)


class ReplicatedLinear(_PlatformLinear):
    """A linear layer held whole by every rank. ``x`` [..., in] -> [..., out]."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, ops: Platform, bias: bool = False,
                 quant: Fp8Config | None = None):
        super().__init__(ops, out_features, in_features, dtype, quant)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load(self, reader, name: str) -> None:
        """Copy ``name`` (and ``name``'s ``.bias`` sibling) from the checkpoint reader."""
        if tuple(reader.shape(name)) != tuple(self.weight.shape):
            raise CheckpointError(name, f"shape {tuple(reader.shape(name))} does not match the model's "
                                  f"{tuple(self.weight.shape)}")
        self._read_into(reader, name, (0, self.weight.shape[0]), None, 0)
        if self.bias is not None:
            bname = name.rsplit(".", 1)[0] + ".bias"
            self.bias.data.copy_(reader.get(bname, dtype=self.bias.dtype))
        self.prepare()


class ColumnParallelLinear(_PlatformLinear):
    """Output dim split over tp ranks: rank r holds rows ``[r * out_local, (r + 1) * out_local)``.

    ``x`` [..., in] -> [..., out_local] (``gather_output=True``: all-gathered to [..., out]).
    ``output_sizes`` lists fused sub-matrices (e.g. gate and up) that are each split separately.
    """

    def __init__(self, in_features: int, output_sizes: list[int], groups: ParallelGroups, dtype: torch.dtype,
                 ops: Platform, bias: bool = False, gather_output: bool = False, quant: Fp8Config | None = None):
        local_sizes = [divide(s, groups.tp_size, "output size") for s in output_sizes]
        super().__init__(ops, sum(local_sizes), in_features, dtype, quant, local_sizes)
        self.groups = groups
        self.output_sizes = list(output_sizes)
        self.local_sizes = local_sizes
        self.gather_output = gather_output
        out_local = sum(self.local_sizes)
        self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        return tp_all_gather_last_dim(y, self.groups) if self.gather_output else y

    def load(self, reader, names: list[str]) -> None:
        """Read this rank's rows of each fused part ``names[i]`` (one checkpoint tensor per output size)."""
        if len(names) != len(self.output_sizes):
            raise ValueError("one checkpoint name per fused output part is needed")
        offset = 0
        for name, full, local in zip(names, self.output_sizes, self.local_sizes, strict=True):
            start = self.groups.tp_rank * local
            if tuple(reader.shape(name)) != (full, self.weight.shape[1]):
                raise CheckpointError(name, f"expected shape {(full, self.weight.shape[1])}, found "
                                      f"{tuple(reader.shape(name))}")
            self._read_into(reader, name, (start, start + local), None, offset)
            if self.bias is not None:
                bname = name.rsplit(".", 1)[0] + ".bias"
                self.bias.data[offset:offset + local].copy_(
                    reader.get_slice(bname, 0, start, start + local, dtype=self.bias.dtype))
            offset += local
        self.prepare()

    def load_fused(self, reader, name: str) -> None:
        """Read this rank's rows of each fused part from one checkpoint tensor ``name`` that holds the parts one
        after another (``output_sizes`` rows each; e.g. Qwen3.5's ``in_proj_qkv``: query, key, value).

        Raises:
            CheckpointError: ``name`` is not ``[sum(output_sizes), in_features]``.
        """
        if tuple(reader.shape(name)) != (sum(self.output_sizes), self.weight.shape[1]):
            raise CheckpointError(name, f"expected shape {(sum(self.output_sizes), self.weight.shape[1])}, found "
                                  f"{tuple(reader.shape(name))}")
        base = offset = 0
        for full, local in zip(self.output_sizes, self.local_sizes, strict=True):
            start = base + self.groups.tp_rank * local
            self._read_into(reader, name, (start, start + local), None, offset)
            base, offset = base + full, offset + local
        self.prepare()


class RowParallelLinear(_PlatformLinear):
    """Input dim split over tp ranks; partial outputs are summed with an all-reduce on the tp group.

    ``x`` [..., in_local] -> [..., out] (``reduce_results=False`` leaves the partial sum to the caller).
    """

    def __init__(self, in_features: int, out_features: int, groups: ParallelGroups, dtype: torch.dtype,
                 ops: Platform, bias: bool = False, reduce_results: bool = True, quant: Fp8Config | None = None):
        in_local = divide(in_features, groups.tp_size, "input size")
        super().__init__(ops, out_features, in_local, dtype, quant)
        self.groups = groups
        self.in_local = in_local
        self.reduce_results = reduce_results
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        if self.reduce_results:
            tp_all_reduce(y, self.groups)
        if self.bias is not None:
            y = y + self.bias
        return y

    def load(self, reader, name: str) -> None:
        """Read this rank's columns of ``name``."""
        start = self.groups.tp_rank * self.in_local
        out = self.weight.shape[0]
        if reader.shape(name)[0] != out or len(reader.shape(name)) != 2:
            raise CheckpointError(name, f"expected {out} output rows, found shape {tuple(reader.shape(name))}")
        self._read_into(reader, name, (0, out), (start, start + self.in_local), 0)
        if self.bias is not None:
            self.bias.data.copy_(reader.get(name.rsplit(".", 1)[0] + ".bias", dtype=self.bias.dtype))
        self.prepare()


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads: rank r holds ``num_heads / tp`` query heads and its kv heads.

    KV heads are replicated when ``tp_size > num_kv_heads``. ``x`` [..., hidden] -> [..., (hq + 2 hkv) * D].
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 groups: ParallelGroups, dtype: torch.dtype, ops: Platform, bias: bool = False,
                 quant: Fp8Config | None = None):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, groups.tp_size, "num_attention_heads")
        if num_kv_heads >= groups.tp_size:
            self.num_kv_heads = divide(num_kv_heads, groups.tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(groups.tp_size, num_kv_heads, "tp_size over num_key_value_heads")
        super().__init__(hidden_size, [self.num_heads * head_dim * groups.tp_size,
                                       self.num_kv_heads * head_dim * groups.tp_size,
                                       self.num_kv_heads * head_dim * groups.tp_size], groups, dtype, ops, bias,
                         quant=quant)

    def load(self, reader, names: list[str]) -> None:  # names = [q, k, v]
        """Read this rank's query heads and its (possibly replicated) kv heads."""
        q_local = self.num_heads * self.head_dim
        kv_local = self.num_kv_heads * self.head_dim
        kv_start = (self.groups.tp_rank // self.kv_replicas) * kv_local
        spans = [(names[0], self.groups.tp_rank * q_local, q_local),
                 (names[1], kv_start, kv_local), (names[2], kv_start, kv_local)]
        offset = 0
        for name, start, n in spans:
            self._read_into(reader, name, (start, start + n), None, offset)
            if self.bias is not None:
                self.bias.data[offset:offset + n].copy_(
                    reader.get_slice(name.rsplit(".", 1)[0] + ".bias", 0, start, start + n, dtype=self.bias.dtype))
            offset += n
        self.prepare()
