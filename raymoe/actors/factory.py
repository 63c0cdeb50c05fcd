"""Assembly of a driver and its ranks from an ``EngineConfig`` (shared by Engine, DriverService and the server)."""

from __future__ import annotations

import dataclasses

from raymoe.actors.driver import Driver
from raymoe.actors.executor import LocalExecutor, RayExecutor
from raymoe.actors.hosted_driver import HostedDriver
from raymoe.config import EngineConfig, ModelConfig
from raymoe.eplb.controller import EplbController, ep_node_count
from raymoe.eplb.initial import initial_expert_location
from raymoe.eplb.location import ExpertLocation
from raymoe.errors import InvalidRequestError
from raymoe.platform.selector import select_platform
from raymoe.runner.runner_config import RunnerConfig
from raymoe.tokenizer import detokenizer, eos_token_ids


def runner_config_for(config: EngineConfig) -> RunnerConfig:
    """The per-rank runner settings implied by ``config`` (KV and row sizes are per DP group; the MoE all-to-all
    mode as the ranks run it: the platform's ``effective_a2a_mode``). Built once per engine (``build_driver``).

    Raises:
        ValueError: ``config`` is not resolved (``raymoe.cluster.device_choice.resolve_engine_config``).
    """
    require_resolved(config)
    device = config.device
    a2a_mode = select_platform(device).effective_a2a_mode(config.moe_comm.a2a_mode, config.parallel.ep_size)
    return RunnerConfig(
        model_path=config.model, dtype=config.dtype, num_kv_slots=config.cache.kv_pool_slots,
        max_req_rows=config.scheduler.req_pool_rows, max_context_len=config.cache.max_context_len,
        page_size=config.cache.page_tokens, attention_backend=config.attention_backend, seed=config.seed,
        device=device, graph=config.graph, moe_comm=dataclasses.replace(config.moe_comm, a2a_mode=a2a_mode),
        overlap=config.overlap, cpu_threads=config.cpu_threads, cpu_rank_nice=config.cpu_rank_nice,
        eplb=config.eplb, expert_location=initial_location(config, ModelConfig.from_hf(config.model)),
        speculative=config.speculative, swa_kv_eviction=config.cache.swa_kv_eviction)


def initial_location(config: EngineConfig, model_config: ModelConfig) -> ExpertLocation | None:
    """The expert placement the ranks load (``raymoe.eplb.initial``), or None when nothing asks for one.

    Raises:
        InvalidRequestError: ``init_expert_location`` cannot be read or does not fit the model and EP size
            (``init_expert_location`` named); a model family without EPLB support.
    """
    e = config.eplb
    if not e.uses_location or model_config.num_experts == 0:
        return None
    if model_config.gpt_oss is not None:
        raise InvalidRequestError("ep_num_redundant_experts", "expert load records, redundant experts and "
                                  "rebalancing are not supported for gpt-oss models")
    num_layers = sum(model_config.is_moe_layer(i) for i in range(model_config.num_hidden_layers))
    return initial_expert_location(num_layers, model_config.num_experts, config.parallel.ep_size,
                                   e.ep_num_redundant_experts, e.init_expert_location, _routing_groups(model_config),
                                   num_fault_domains=_fault_domains(config))


def _fault_domains(config: EngineConfig) -> int:
    """DP groups a placement keeps every expert on two of (elastic EP with experts sharded over them), else 1."""
    p = config.parallel
    return p.dp_size if config.faults.elastic_ep and p.ep_size > 1 else 1


def _routing_groups(model_config: ModelConfig) -> int:
    """The model's routing groups (DeepSeek's ``n_group`` under group-limited routing), else 1."""
    r = model_config.router
    return r.n_group if r.topk_method == "group_limited" else 1


def eplb_controller(config: EngineConfig, model_config: ModelConfig,
                    location: ExpertLocation | None) -> EplbController | None:
    """The driver's expert-load window and rebalance planner for ranks loaded with ``location`` (None: none)."""
    if location is None or not config.eplb.records_load:
        return None
    e = config.eplb
    return EplbController(location, config.parallel.ep_size, e.enable_eplb, e.eplb_record_interval,
                          e.eplb_window_steps, e.eplb_rebalance_num_iterations, e.eplb_min_window_tokens,
                          e.eplb_transfer_experts_per_step, num_groups=_routing_groups(model_config),
                          pieces_per_expert=e.eplb_transfer_pieces_per_expert,
                          min_balance_gain=e.eplb_min_balance_gain,
                          fault_domain_ranks=config.parallel.tp_size if _fault_domains(config) > 1 else 0)


def _set_ep_nodes(eplb: EplbController | None, executor) -> None:
    """Tell the placement how many nodes the EP ranks span (``ep_node_count`` of the ranks' placements)."""
    placements = getattr(executor, "placements", None)
    if eplb is not None and placements:
        eplb.num_nodes = ep_node_count([p.node_id for p in placements])


def build_executor(config: EngineConfig, runner_cfg: RunnerConfig):
    """In-process rank for world size 1, else rank actors on Ray (joining ``config.ray_address``), each built from
    ``runner_cfg`` (``runner_config_for(config)``)."""
    if config.parallel.world_size == 1:
        return _local_executor(config, runner_cfg)
    from raymoe.cluster.bootstrap import init_ray

    init_ray(config.ray_address)
    return RayExecutor(runner_cfg, config.parallel, use_gpu=config.parallel.bundle_gpus, fanout=config.fanout,
                       step_timeout_s=config.step_timeout_s, elastic=config.faults.elastic_ep,
                       rejoin_after_s=config.faults.elastic_ep_rejoin_after_s, **startup_kwargs(config))


def _local_executor(config: EngineConfig, runner_cfg: RunnerConfig) -> LocalExecutor:
    """The one rank, built in this process, with one start-up line (``raymoe.actors.startup_progress``)."""
    import time

    from raymoe.actors.startup_progress import console_progress

    t0 = time.perf_counter()
    executor = LocalExecutor(runner_cfg)
    graphs = executor.worker.runner.graph_runner
    console_progress(f"1 {config.device} rank ({config.dtype}) in this process: weights loaded and "
                     f"{len(graphs.graphs) if graphs is not None else 0} decode graphs captured in "
                     f"{time.perf_counter() - t0:.1f} s")
    return executor


def startup_kwargs(config: EngineConfig) -> dict:
    """``RayExecutor``'s start-up bounds (``raymoe.actors.startup_budget``) and its progress lines."""
    from raymoe.actors.startup_budget import startup_budget
    from raymoe.actors.startup_progress import console_progress

    budget = startup_budget(config)
    how = (f"derived: up to {budget.weight_bytes_per_rank / 2**30:.2f} GiB of weights and {budget.decode_graphs} "
           "decode graphs per rank" if budget.derived else "load_timeout_s")
    console_progress(f"starting {config.parallel.world_size} {config.device} ranks ({config.dtype}); bounds: placement "
                     f"{budget.placement_s:.0f} s, weights + graphs {budget.load_s:.0f} s ({how})")
    return {"placement_timeout_s": budget.placement_s, "load_timeout_s": budget.load_s,
            "progress": console_progress}


def require_resolved(config: EngineConfig) -> None:
    """Refuse a config whose device or per-device defaults are still undecided.

    Raises:
        ValueError: naming what to call first.
    """
    if not config.resolved:
        raise ValueError("the engine config's device is not resolved: pass it through "
                         "raymoe.cluster.device_choice.resolve_engine_config (or raymoe.config.device_defaults."
                         "with_device) once, before building the driver")


def hosts_groups(config: EngineConfig) -> bool:
    """Whether each DP group's scheduler runs in a process of its own (``EngineConfig.group_schedulers`` of the
    resolved config: ``raymoe.config.device_defaults``)."""
    return config.parallel.world_size > 1 and config.group_schedulers == "actors"


def build_driver(config: EngineConfig, model_config: ModelConfig, tokenizer,
                 allow_hosted: bool = True) -> Driver | HostedDriver:
    """The engine's driver over freshly started ranks: a :class:`Driver` holding the ``dp_size`` group schedulers,
    or a :class:`HostedDriver` over one group process per DP group (:func:`hosts_groups`; only with
    ``allow_hosted``: its groups send their rows to a front end's channel, which the offline ``Engine`` has not).

    Raises:
        InvalidRequestError: ``group_schedulers="actors"`` without ``allow_hosted``.
    """
    runner_cfg = runner_config_for(config)
    eplb = eplb_controller(config, model_config, runner_cfg.expert_location)
    if not allow_hosted and config.group_schedulers == "actors" and config.parallel.world_size > 1:
        raise InvalidRequestError("group_schedulers", "the offline Engine keeps its DP groups in its own process; "
                                                      "group scheduler processes serve through `raymoe serve`")
    if allow_hosted and hosts_groups(config):
        from raymoe.actors.group_hosts import GroupHosts
        from raymoe.cluster.bootstrap import init_ray

        init_ray(config.ray_address)
        ranks = RayExecutor(runner_cfg, config.parallel, use_gpu=config.parallel.bundle_gpus, fanout="groups",
                            step_timeout_s=config.step_timeout_s, **startup_kwargs(config))
        _set_ep_nodes(eplb, ranks)
        return HostedDriver(config, GroupHosts(config, ranks), config.parallel.dp_size,
                            graph_capture_sizes=runner_cfg.graph_capture_sizes, a2a_mode=runner_cfg.moe_comm.a2a_mode,
                            vocab_size=model_config.vocab_size, eplb=eplb)
    executor = build_executor(config, runner_cfg)
    _set_ep_nodes(eplb, executor)
    return Driver(config, executor, eos_token_ids(model_config, tokenizer),
                  detokenizer(tokenizer), dp_size=config.parallel.dp_size,
                  graph_capture_sizes=runner_cfg.graph_capture_sizes, a2a_mode=runner_cfg.moe_comm.a2a_mode,
                  vocab_size=model_config.vocab_size, eplb=eplb)
