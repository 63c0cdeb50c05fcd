"""Checkpoint reader views that answer raymoe's tensor names with a checkpoint's own on-disk names (a family that
stores its tensors under other names: Mixtral's experts, the language model of an image-text checkpoint).

A view has the reader interface the layers use (``get``, ``get_slice``, ``shape``, ``in``); a subclass says only how a
name maps (:meth:`RenamedReader.disk_name`).
"""

from __future__ import annotations

import torch


class RenamedReader:
    """A ``CheckpointReader`` seen under other names; subclasses define :meth:`disk_name`.

    Args:
        reader: a ``CheckpointReader`` (``get``, ``get_slice``, ``shape``, ``in``).
    """

    def __init__(self, reader):
        self.reader = reader

    @staticmethod
    def disk_name(name: str) -> str:
        """The on-disk name of raymoe's ``name`` (identity here)."""
        return name

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.disk_name(name) in self.reader

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.reader.get(self.disk_name(name), dtype=dtype)

    def get_slice(self, name: str, dim: int, start: int, end: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.reader.get_slice(self.disk_name(name), dim, start, end, dtype=dtype)

    def shape(self, name: str):
        return self.reader.shape(self.disk_name(name))
