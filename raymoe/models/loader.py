"""Read tensors of a Hugging Face safetensors checkpoint, lazily and by slice.

``CheckpointReader`` indexes a model folder (``model.safetensors.index.json`` when sharded, else every
``*.safetensors`` file), validates every file's header up front, and then reads single tensors or slices along one
dimension through ``safetensors.safe_open`` memory maps, so a tensor-parallel rank reads only its own shard.
Architecture-specific name mapping (HF names -> raymoe parameters) lives with each model, not here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from raymoe.errors import CheckpointError, InvalidRequestError

INDEX_FILE = "model.safetensors.index.json"

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Stored dtypes that only mean something with their scales: never cast silently (:func:`_cast`)."""


def cast_stored(t: torch.Tensor, dtype: torch.dtype | None, name: str, file: Path | str) -> torch.Tensor:
    """``t`` in ``dtype`` (None: as stored). Raises CheckpointError (naming ``file``): ``t`` is stored in FP8 and
    ``dtype`` is another dtype (the cast would drop its scales: such a tensor is read by the quantized layers, stored
    dtype kept)."""
    if dtype is None or t.dtype == dtype:
        return t
    if t.dtype in FP8_DTYPES:
        raise CheckpointError(str(file), f"tensor {name!r} is stored as {t.dtype} and cannot be cast to {dtype}: "
                              "its module is quantized (quantization_config) but read as unquantized (listed in "
                              "modules_to_not_convert, or a module raymoe keeps unquantized)")
    return t.to(dtype)


def slice_dim(name: str, shape: Sequence[int], dim: int, start: int, stop: int) -> int:
    """``dim`` made non-negative, once ``tensor[..., start:stop, ...]`` along it is checked to be inside ``shape``.

    Raises:
        InvalidRequestError: ``dim`` out of range or the range is not inside ``[0, shape[dim]]``.
    """
    if not -len(shape) <= dim < len(shape):
        raise InvalidRequestError("dim", f"dim {dim} is out of range for {name!r} of shape {tuple(shape)}")
    dim %= len(shape)
    if not 0 <= start <= stop <= shape[dim]:
        raise InvalidRequestError("start", f"range [{start}, {stop}) is outside dim {dim} of size {shape[dim]}")
    return dim


class CheckpointReader:
    """Lazy, validated access to the safetensors weights of one model folder.

    Tensors are returned under their on-disk names with their stored shapes and dtypes (unless ``dtype`` is given).
    File handles are opened during validation and kept until ``close()`` (or the end of a ``with`` block).

    Args:
        path: the model folder.

    Raises:
        CheckpointError: the folder does not exist; it has no safetensors weights; the index is unreadable or names
            a missing file or a tensor its file lacks; a file's header does not parse (truncated or corrupt file,
            named in the error); or two files hold the same tensor name.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(str(self.path), "model folder does not exist")
        self._handles: dict[Path, Any] = {}
        self._file_of: dict[str, Path] = {}
        index = self.path / INDEX_FILE
        try:
            if index.is_file():
                self._index_sharded(index)
            else:
                self._index_files(sorted(self.path.glob("*.safetensors")))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ indexing
    def _open(self, file: Path) -> Any:
        if not file.is_file():
            raise CheckpointError(str(file), "safetensors file is missing")
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(str(file), f"cannot read safetensors file (truncated or corrupt?): {e}") from e
        self._handles[file] = handle
        return handle

    def _add(self, name: str, file: Path) -> None:
        other = self._file_of.get(name)
        if other is not None and other != file:
            raise CheckpointError(str(file), f"tensor {name!r} is also in {other.name}")
        self._file_of[name] = file

    def _index_files(self, files: list[Path]) -> None:
        if not files:
            raise CheckpointError(str(self.path), "no *.safetensors weights in the model folder")
        for file in files:
            for name in self._open(file).keys():
                self._add(name, file)

    def _index_sharded(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(str(index), f"cannot parse the safetensors index: {e}") from e
        listed: dict[Path, set[str]] = {}
        for name, fname in weight_map.items():
            listed.setdefault(self.path / str(fname), set()).add(str(name))
        for file in sorted(listed):
            stored = set(self._open(file).keys())
            absent = listed[file] - stored
            if absent:
                raise CheckpointError(str(file), f"lacks tensors listed in {INDEX_FILE}: {sorted(absent)[:5]}")
            for name in stored:
                self._add(name, file)

    # ------------------------------------------------------------------ queries
    def names(self) -> set[str]:
        """All tensor names (on-disk HF names) of the checkpoint."""
        return set(self._file_of)

    def files(self) -> list[Path]:
        """The safetensors files, sorted."""
        return sorted(set(self._file_of.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __len__(self) -> int:
        return len(self._file_of)

    def _handle(self, name: str) -> Any:
        file = self._file_of.get(name)
        if file is None:
            raise CheckpointError(str(self.path), f"tensor {name!r} is not in the checkpoint")
        handle = self._handles.get(file)
        if handle is None:  # reopened after close()
            handle = self._open(file)
        return handle

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of tensor ``name`` (no data is read).

        Raises:
            CheckpointError: no tensor ``name``.
        """
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read the whole tensor ``name`` (stored shape; stored dtype, or cast to ``dtype``).

        Raises:
            CheckpointError: no tensor ``name``, its data cannot be read, or it is stored in FP8 and ``dtype`` is
                another dtype.
        """
        handle = self._handle(name)
        try:
            t = handle.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(str(self._file_of[name]), f"cannot read tensor {name!r}: {e}") from e
        return cast_stored(t, dtype, name, self._file_of[name])

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read ``tensor[..., start:stop, ...]`` along ``dim`` only (equal to ``get(name)`` sliced that way).

        Args:
            dim: dimension to slice (negative counts from the end).
            start, stop: element range along ``dim``, ``0 <= start <= stop <= shape[dim]``.
            dtype: cast the result to this dtype (default: stored dtype).

        Returns:
            tensor of the stored shape with ``shape[dim] = stop - start``.

        Raises:
            CheckpointError: no tensor ``name``, or it is stored in FP8 and ``dtype`` is another dtype.
            InvalidRequestError: ``dim`` out of range or the range is not inside ``[0, shape[dim]]``.
        """
        handle = self._handle(name)
        sl = handle.get_slice(name)
        dim = slice_dim(name, sl.get_shape(), dim, start, stop)
        index = (slice(None),) * dim + (slice(start, stop),)
        try:
            t = sl[index]
        except SafetensorError as e:
            raise CheckpointError(str(self._file_of[name]), f"cannot read tensor {name!r}: {e}") from e
        return cast_stored(t, dtype, name, self._file_of[name])

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release the file handles (memory maps). Later reads reopen the files."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, tensors={len(self._file_of)}, files={len(self.files())})"
