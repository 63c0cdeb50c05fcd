"""Frozen configuration records.

``model``: ``ModelConfig``, the Hugging Face ``config.json`` normalized. The engine's options, each declared once as
a field with its help, choices and default (``option``): ``CacheConfig`` sizes the KV cache, ``SchedulerConfig``
the per-DP-group scheduler, ``ParallelConfig`` / ``OverlapConfig`` / ``MoeCommConfig`` the ranks' layout and MoE
exchange, ``GraphConfig`` decode graph capture, ``StartupConfig`` the start-up bounds, ``EplbConfig`` expert load
balancing, ``FaultConfig`` what a request survives, ``SpeculativeConfig`` speculative decoding, and ``EngineConfig`` is
what ``Engine(model, **options)`` accepts; ``engine_options`` is the flat namespace of them all.
"""

from raymoe.config.engine import FANOUTS, EngineConfig
from raymoe.config.engine_options import engine_config_from_options, engine_options
from raymoe.config.eplb import EplbConfig
from raymoe.config.faults import FaultConfig
from raymoe.config.graph import GraphConfig
from raymoe.config.model import ModelConfig
from raymoe.config.parallel import CPU_COMM_MODES, MoeCommConfig, OverlapConfig, ParallelConfig
from raymoe.config.scheduling import CacheConfig, SchedulerConfig
from raymoe.config.speculative import SpeculativeConfig
from raymoe.config.startup import StartupConfig

__all__ = ["CPU_COMM_MODES", "FANOUTS", "CacheConfig", "EngineConfig", "EplbConfig", "FaultConfig", "GraphConfig",
           "ModelConfig", "MoeCommConfig", "OverlapConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig",
           "StartupConfig", "engine_config_from_options", "engine_options"]
