"""Whether two model configs describe one architecture: a weight update may only switch between checkpoints whose
tensors and rules are the served model's (``raymoe.runner.weight_reload``, ``raymoe.actors.weight_update``)."""

from __future__ import annotations

import dataclasses

from raymoe.config.model import ModelConfig
from raymoe.errors import CheckpointError


def architecture_mismatch(served: ModelConfig, new: ModelConfig) -> str | None:
    """The first compared field of ``ModelConfig`` (every field but the raw ``hf_config``) whose value differs
    between ``served`` and ``new``, or None when they describe the same architecture."""
    for f in dataclasses.fields(ModelConfig):
        if f.compare and getattr(served, f.name) != getattr(new, f.name):
            return f.name
    return None


def check_same_architecture(served: ModelConfig, model_path: str) -> None:
    """Refuse a checkpoint folder whose ``config.json`` does not describe ``served``'s architecture (sizes, layer
    types, quantization, EOS ids: everything the ranks' tensors and the driver's rules were built from).

    Raises:
        CheckpointError: the folder or its config is missing or unreadable, or a field differs (named, with both
            values).
    """
    new = ModelConfig.from_hf(model_path)
    name = architecture_mismatch(served, new)
    if name is not None:
        raise CheckpointError(f"{model_path}/config.json",
                              f"{name} is {getattr(new, name)!r} where the served model has "
                              f"{getattr(served, name)!r}; weights can only be updated within one architecture")
