"""The expert placement an engine starts with: trivial, a placement file, or a placement computed from a load
record (``init_expert_location``; the file ``raymoe eplb dump`` writes)."""

from __future__ import annotations

import torch

from raymoe.eplb.location import ExpertLocation, read_location_file
from raymoe.eplb.placement import rebalance_experts
from raymoe.errors import InvalidRequestError


def initial_expert_location(num_layers: int, num_logical: int, ep_size: int, num_redundant: int,
                            path: str | None, num_groups: int = 1, num_nodes: int = 1,
                            num_fault_domains: int = 1) -> ExpertLocation:
    """The start placement of ``num_layers`` MoE layers of ``num_logical`` experts over ``ep_size`` ranks with
    ``num_redundant`` extra slots. A placement computed from a load record keeps every expert on two of
    ``num_fault_domains`` DP groups where the slots allow (``rebalance_experts``); a placement file is taken as
    it is.

    Raises:
        InvalidRequestError: ``num_logical + num_redundant`` is not a multiple of ``ep_size``
            (``ep_num_redundant_experts``), or the file cannot be read, is neither a placement nor a load record, or
            does not match the model (layers, experts) or the slot count (``init_expert_location``).
    """
    num_physical = num_logical + num_redundant
    if num_physical % ep_size:
        raise InvalidRequestError("ep_num_redundant_experts", f"num_experts + ep_num_redundant_experts = "
                                                              f"{num_physical} must be a multiple of ep_size {ep_size}")
    if path is None:
        return ExpertLocation.trivial(num_layers, num_logical, num_physical)
    try:
        data = read_location_file(path)
        if "physical_to_logical" in data:
            location = ExpertLocation.from_json(data)
        elif "expert_load" in data:
            load = torch.tensor(data["expert_load"], dtype=torch.float64)
            if load.dim() != 2:
                raise ValueError("expert_load must be [layers][experts]")
            p2l, _ = rebalance_experts(load, num_physical, num_groups, num_nodes, ep_size,
                                       num_fault_domains=num_fault_domains)
            location = ExpertLocation(num_logical, tuple(tuple(int(x) for x in r) for r in p2l.tolist()))
        else:
            raise ValueError("neither physical_to_logical nor expert_load in it")
    except (ValueError, TypeError) as e:
        raise InvalidRequestError("init_expert_location", f"{path}: {e}") from e
    if (location.num_layers, location.num_logical, location.num_physical) != (num_layers, num_logical, num_physical):
        raise InvalidRequestError(
            "init_expert_location", f"{path} places {location.num_logical} experts of {location.num_layers} MoE "
            f"layers over {location.num_physical} slots; the engine has {num_logical} experts, {num_layers} MoE "
            f"layers and {num_physical} slots")
    return location
