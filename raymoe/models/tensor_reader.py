"""A model's tensors handed over in memory, read as a checkpoint folder is (``CheckpointReader``'s methods), so every
layer's ``load`` takes them unchanged: the weights a trainer pushes to a serving engine without writing a checkpoint
(``raymoe.actors.weight_update``, SGLang's ``update_weights_from_tensor``).

The mapping holds Hugging Face names -> CPU or device tensors (a ``state_dict`` of the model's ``transformers``
class, FP8 weights with their ``weight_scale_inv`` where the served checkpoint has them). A Ray ``ObjectRef`` to such
a mapping is fetched once (:func:`resolve_tensors`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from raymoe.errors import CheckpointError
from raymoe.models.loader import cast_stored, slice_dim

SOURCE = "<tensors>"
"""The path named by the errors of a :class:`TensorReader`."""


def resolve_tensors(tensors: Any) -> Mapping[str, torch.Tensor]:
    """``tensors`` as a mapping: itself, or the value of a Ray ``ObjectRef`` (fetched here; Ray imported only then).

    Raises:
        CheckpointError: not a mapping of names to tensors.
    """
    if type(tensors).__name__ == "ObjectRef":
        import ray

        tensors = ray.get(tensors)
    if not isinstance(tensors, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in tensors.items()):
        raise CheckpointError(SOURCE, "weights must be a mapping of tensor names (str) to torch tensors")
    return tensors


class TensorReader:
    """``CheckpointReader``'s reads over an in-memory mapping (module docstring).

    Args:
        tensors: Hugging Face names -> tensors (kept, not copied).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> set[str]:
        """All tensor names."""
        return set(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def _tensor(self, name: str) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(SOURCE, f"tensor {name!r} is not in the weights given (a weight update takes every "
                                          "tensor of the checkpoint)")
        return t.detach()

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name``. Raises CheckpointError: no tensor ``name``."""
        return tuple(self._tensor(name).shape)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` on the CPU (its dtype, or cast to ``dtype``).

        Raises:
            CheckpointError: no tensor ``name``, or an FP8 tensor asked for in another dtype.
        """
        return cast_stored(self._tensor(name).cpu(), dtype, name, SOURCE)

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tensor[..., start:stop, ...]`` along ``dim``, as ``CheckpointReader.get_slice``.

        Raises:
            CheckpointError: no tensor ``name``, or an FP8 tensor asked for in another dtype.
            InvalidRequestError: ``dim`` out of range or the range outside ``[0, shape[dim]]``.
        """
        t = self._tensor(name)
        dim = slice_dim(name, t.shape, dim, start, stop)
        return cast_stored(t.narrow(dim, start, stop - start).cpu(), dtype, name, SOURCE)

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
