"""Weights pushed to a running engine from any Ray program on its cluster (a trainer), by the engine's name
(``raymoe serve --engine-name NAME``, ``EngineClient(..., engine_name=NAME)``): the Ray-native form of SGLang's
``update_weights_from_tensor``. The tensors travel through Ray's object store: the driver actor keeps a copy of its
own (``DriverActor.update_weights``: it outlives the caller, and ranks rebuilt after a fault fetch it again); every
rank fetches it and loads its shard (``raymoe.actors.weight_update``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from raymoe.actors.weight_update import WeightUpdate, WeightUpdateResult


def update_weights_from_tensors(engine_name: str, tensors: Mapping[str, torch.Tensor],
                                weight_version: str | None = None, *, abort_all_requests: bool = False,
                                retract_requests: bool = False, timeout_s: float = 300.0) -> WeightUpdateResult:
    """Serve ``tensors`` on the engine ``engine_name`` once its requests in flight are done (or aborted, or
    retracted: ``WeightUpdate``), and return how it ended; blocks until then.

    Args:
        engine_name: the name the engine was started under.
        tensors: Hugging Face names -> tensors, every tensor of the served checkpoint (a ``state_dict`` of its
            ``transformers`` class; FP8 weights with their scales where it has them); device tensors are copied
            to the CPU first.
        weight_version: the name the engine reports for them (None: kept).
        abort_all_requests, retract_requests, timeout_s: as ``WeightUpdate``.
    Returns:
        the result (``success`` False, ``param`` ``"tensors"``, for a tensor missing or misshapen, named; the
        engine then serves its previous weights).
    Raises:
        ValueError: no live engine has that name, or the options contradict each other.
    """
    import ray

    from raymoe.actors.driver_actor import find_driver_actor

    driver = find_driver_actor(engine_name)
    ref = ray.put({name: t.detach().cpu() for name, t in tensors.items()})
    update = WeightUpdate(tensors=ref, weight_version=weight_version, abort_all_requests=abort_all_requests,
                          retract_requests=retract_requests, timeout_s=timeout_s)
    return ray.get(driver.update_weights.remote(update))
