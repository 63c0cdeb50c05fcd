"""Assembly of a driver and its ranks from an ``EngineConfig`` (shared by Engine, DriverService and the server)."""

from __future__ import annotations

import dataclasses

from raymoe.actors.driver import Driver
from raymoe.actors.executor import LocalExecutor, RayExecutor
from raymoe.config import EngineConfig, ModelConfig
from raymoe.platform.selector import select_platform
from raymoe.runner.device import engine_device
from raymoe.runner.runner_config import RunnerConfig
from raymoe.tokenizer import eos_token_ids


def runner_config_for(config: EngineConfig) -> RunnerConfig:
    """The per-rank runner settings implied by ``config`` (KV and row sizes are per DP group; the MoE all-to-all
    mode as the ranks run it: the platform's ``effective_a2a_mode``). Built once per engine (``build_driver``)."""
    device = engine_device(config.device)
    a2a_mode = select_platform(device).effective_a2a_mode(config.moe_comm.a2a_mode, config.parallel.ep_size)
    return RunnerConfig(
        model_path=config.model, dtype=config.dtype, num_kv_slots=config.cache.kv_pool_slots,
        max_req_rows=config.scheduler.req_pool_rows, max_context_len=config.cache.max_context_len,
        page_size=config.cache.page_tokens, attention_backend=config.attention_backend, seed=config.seed,
        device=device, graph=config.graph, moe_comm=dataclasses.replace(config.moe_comm, a2a_mode=a2a_mode),
        overlap=config.overlap, cpu_threads=config.cpu_threads, cpu_rank_nice=config.cpu_rank_nice)


def build_executor(config: EngineConfig, runner_cfg: RunnerConfig):
    """In-process rank for world size 1, else rank actors on Ray (joining ``config.ray_address``), each built from
    ``runner_cfg`` (``runner_config_for(config)``)."""
    if config.parallel.world_size == 1:
        return LocalExecutor(runner_cfg)
    from raymoe.cluster.bootstrap import init_ray

    init_ray(config.ray_address)
    bundle_gpus = config.parallel.bundle_gpus
    use_gpu = runner_cfg.device.startswith("cuda") if bundle_gpus is None else bundle_gpus
    fanout = config.fanout or ("compiled" if runner_cfg.device.startswith("cuda") else "channel")
    return RayExecutor(runner_cfg, config.parallel, use_gpu=use_gpu, fanout=fanout,
                       step_timeout_s=config.step_timeout_s)


def build_driver(config: EngineConfig, model_config: ModelConfig, tokenizer) -> Driver:
    """Driver with ``dp_size`` schedulers over a freshly started executor."""
    def detokenize(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    runner_cfg = runner_config_for(config)
    return Driver(config, build_executor(config, runner_cfg), eos_token_ids(model_config, tokenizer), detokenize,
                  dp_size=config.parallel.dp_size, graph_capture_sizes=runner_cfg.graph_capture_sizes,
                  a2a_mode=runner_cfg.moe_comm.a2a_mode, vocab_size=model_config.vocab_size)
