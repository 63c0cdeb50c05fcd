"""Expert-parallel load balancing (EPLB): expert load recorded per layer, redundant expert slots, placements that
balance per-rank load, and live rebalancing while steps continue."""
