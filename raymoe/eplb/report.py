"""ExpertLoadReport: the driver's expert-load window as plain data, for ``/metrics``, ``raymoe eplb dump`` and an
``init_expert_location`` file (``raymoe.eplb.location`` reads the ``expert_load`` form back)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLoadReport:
    """The recorded expert load and the placement it ran on.

    Attributes:
        num_logical: logical experts E. ep_size: EP ranks. window_steps: steps the window covers (at most
            ``eplb_window_steps``). expert_load: per MoE layer, routed (token, expert) pairs per logical expert over
            the window, [L][E]. balance: per MoE layer, mean / max of per-rank load under ``physical_to_logical``
            (1.0 = even). physical_to_logical: the placement the ranks hold, [L][P]. num_rebalances: rebalances
            planned so far. num_layer_commits: layers switched so far. moving: a rebalance is still moving weights.
    """

    num_logical: int
    ep_size: int
    window_steps: int
    expert_load: list[list[int]]
    balance: list[float]
    physical_to_logical: list[list[int]]
    num_rebalances: int = 0
    num_layer_commits: int = 0
    moving: bool = False

    def to_json(self) -> dict:
        """The dump file's JSON object (``init_expert_location`` accepts it)."""
        return {"num_logical_experts": self.num_logical, "ep_size": self.ep_size, "window_steps": self.window_steps,
                "expert_load": self.expert_load, "balance": self.balance,
                "current_physical_to_logical": self.physical_to_logical, "num_rebalances": self.num_rebalances,
                "num_layer_commits": self.num_layer_commits, "moving": self.moving}
