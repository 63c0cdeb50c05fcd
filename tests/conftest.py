"""Shared fixtures: one seeded tiny Qwen3-MoE checkpoint per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 4-layer, hidden-128, 8-expert (top-2) Qwen3-MoE folder with a trained BPE tokenizer (seed 0)."""
    from raymoe.models.checkpoint import make_checkpoint

    return str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe_tiny", seed=0))
