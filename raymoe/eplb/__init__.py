"""Expert-parallel load balancing (EPLB): expert load, placement of logical experts on physical slots."""
