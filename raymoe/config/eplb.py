"""Expert-parallel load balancing options (``raymoe.eplb``; SGLang's names): every rank and the driver share them."""

from __future__ import annotations

from dataclasses import dataclass

from raymoe.config.option import option
from raymoe.errors import InvalidRequestError


@dataclass(frozen=True)
class EplbConfig:
    """Expert load records, redundant experts and rebalancing; each field's help says what it means.

    Raises:
        InvalidRequestError: a count or size out of range (named).
    """

    enable_eplb: bool = option(
        False, help="rebalance the experts over the EP ranks while serving: every eplb_rebalance_num_iterations steps "
                    "the driver computes a placement from the recorded expert load (DeepSeek's EPLB algorithm), moves "
                    "the weights between ranks in the background, layer by layer, while steps continue, and switches "
                    "each layer at one step boundary (raymoe.eplb.controller). Needs ep_size > 1; implies "
                    "enable_expert_distribution_metrics.")
    ep_num_redundant_experts: int = option(
        0, help="extra physical expert slots of the EP group: it holds num_experts + this many (a multiple of "
                "ep_size in all), hot experts get replicas that share their tokens. Needs ep_size > 1.")
    init_expert_location: str | None = option(
        None, help="a JSON file that places the experts at start: a placement ({\"physical_to_logical\": ...}) or a "
                   "load record written by `raymoe eplb dump` (a placement is computed from it). None: expert e on "
                   "slot e, redundant slots replicating experts 0, 1, ...")
    eplb_rebalance_num_iterations: int = option(
        1000, help="steps from the end of one automatic rebalance to the next (enable_eplb).")
    eplb_window_steps: int = option(
        1000, help="steps of recorded expert load a rebalance and /metrics look at (a sliding window).")
    eplb_record_interval: int = option(
        16, help="steps between two collections of the ranks' expert-load counters (the window advances by this).")
    eplb_min_window_tokens: int = option(
        64, help="a rebalance waits until the window holds at least this many routed tokens per MoE layer.")
    eplb_transfer_experts_per_step: int = option(
        2, help="most expert weight pieces each rank sends or receives per step while a rebalance moves weights "
                "(bounds the extra transfer that overlaps one step).")
    eplb_transfer_pieces_per_expert: int = option(
        1, help="each expert copy of a rebalance moves in this many equal byte ranges, one step's transfer each at "
                "most (spreads a copy's cost over several steps where a step is short next to an expert's bytes).")
    eplb_min_balance_gain: float = option(
        0.02, help="an automatic rebalance moves a MoE layer only when its new placement raises the layer's balance "
                   "(mean / max of per-rank load over the window, 1.0 = even) by at least this much; an admin "
                   "request moves every layer it improves.")
    enable_expert_distribution_metrics: bool = option(
        False, help="count the tokens routed to each expert on every rank (a counter on the device, no host sync) "
                    "and expose the load per MoE layer and expert and the per-layer balance on /metrics.")

    def __post_init__(self) -> None:
        if not isinstance(self.ep_num_redundant_experts, int) or self.ep_num_redundant_experts < 0:
            raise InvalidRequestError("ep_num_redundant_experts", f"must be an integer >= 0, got "
                                                                  f"{self.ep_num_redundant_experts!r}")
        for name in ("eplb_rebalance_num_iterations", "eplb_window_steps", "eplb_record_interval",
                     "eplb_transfer_experts_per_step", "eplb_transfer_pieces_per_expert"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidRequestError(name, f"must be a positive integer, got {v!r}")
        if not 0.0 <= self.eplb_min_balance_gain <= 1.0:
            raise InvalidRequestError("eplb_min_balance_gain", f"must be in [0, 1], got {self.eplb_min_balance_gain!r}")
        if not isinstance(self.eplb_min_window_tokens, int) or self.eplb_min_window_tokens < 0:
            raise InvalidRequestError("eplb_min_window_tokens", "must be an integer >= 0")

    @property
    def records_load(self) -> bool:
        """Whether the ranks count expert load."""
        return self.enable_eplb or self.enable_expert_distribution_metrics

    @property
    def uses_location(self) -> bool:
        """Whether the ranks route through an expert location (load records, redundant slots, rebalancing or a
        given placement)."""
        return self.records_load or self.ep_num_redundant_experts > 0 or self.init_expert_location is not None
