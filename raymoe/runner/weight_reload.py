"""A rank's weights replaced from another source of the same architecture, while it keeps its KV pools, attention
backend and graphs: the weight updates of a reinforcement-learning loop, where a trainer writes a new checkpoint
(SGLang's ``update_weights_from_disk``) or hands over its tensors (``update_weights_from_tensor``) and the serving
engine switches to them between rollouts.

Every parameter is written in place (the layers' ``load`` copies into the tensors they allocated), so what holds a
parameter keeps holding it. What a platform prepared of a weight (a CPU rank's packed panels, a GPU rank's FP8
scale layouts) is made again by the same loads. Decode graphs that bound those prepared tensors by address (CUDA
graphs: ``GraphCapture.binds_addresses``) are captured again; recordings (CPU) read them at every replay.

The driver runs this on every rank at once, while no step is in flight (``raymoe.actors.weight_update``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from raymoe.config.model_compat import check_same_architecture
from raymoe.models.loader import CheckpointReader
from raymoe.models.tensor_reader import TensorReader, resolve_tensors


def open_weights(model_path: str, tensors: Any = None):
    """The reader of a weight source: ``tensors`` (a mapping of Hugging Face names to tensors, or a Ray
    ``ObjectRef`` to one; every tensor of the checkpoint) when given, else the folder ``model_path``.

    Raises:
        CheckpointError: the folder cannot be read, or ``tensors`` is not such a mapping.
    """
    if tensors is not None:
        return TensorReader(resolve_tensors(tensors))
    return CheckpointReader(model_path)


@torch.inference_mode()
def reload_weights(runner, model_path: str, tensors: Any = None) -> float:
    """Load a weight source (:func:`open_weights`) into ``runner``'s model (a ``raymoe.runner.model_runner.
    ModelRunner``: its shard of this rank, its MTP layer where it drafts with one) in place; returns the seconds it
    took. A folder's ``config.json`` must describe the served architecture; tensors are checked by name and shape
    as they load.

    An EAGLE draft head (``speculative_draft_model_path``) is a checkpoint of its own and is kept (it shares the
    target's embedding and LM head, which are updated). The KV cache is not touched: the driver flushes what its
    radix caches hold, computed with the old weights.

    Raises:
        CheckpointError: another architecture (before any tensor is written), or a tensor missing or misshapen
            (the model then holds a mix of both sources: the caller loads a whole source again).
    """
    t0 = time.perf_counter()
    if tensors is None:
        check_same_architecture(runner.model_config, model_path)
    with open_weights(model_path, tensors) as reader:
        runner.model.load_weights(reader)
    if runner.graph_runner is not None and runner.ops.graph_capture(runner.device).binds_addresses:
        runner.graph_runner = None  # the old graphs' pool goes before the new capture takes memory
        runner.graph_runner = runner.build_graph_runner()
    return time.perf_counter() - t0
