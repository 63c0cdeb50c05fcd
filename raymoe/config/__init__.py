"""Frozen configuration records.

``model``: ``ModelConfig``, the Hugging Face ``config.json`` normalized. The engine's options: ``CacheConfig`` sizes
the KV cache, ``SchedulerConfig`` the per-DP-group scheduler, ``ParallelConfig`` / ``OverlapConfig`` /
``MoeCommConfig`` the ranks' layout and MoE exchange, ``GraphConfig`` decode graph capture, and ``EngineConfig`` is
what ``Engine(model, **options)`` accepts.
"""

from raymoe.config.engine import EngineConfig
from raymoe.config.graph import GraphConfig
from raymoe.config.model import ModelConfig
from raymoe.config.parallel import CPU_COMM_MODES, MoeCommConfig, OverlapConfig, ParallelConfig
from raymoe.config.scheduling import CacheConfig, SchedulerConfig

__all__ = ["CPU_COMM_MODES", "CacheConfig", "EngineConfig", "GraphConfig", "ModelConfig", "MoeCommConfig",
           "OverlapConfig", "ParallelConfig", "SchedulerConfig"]
