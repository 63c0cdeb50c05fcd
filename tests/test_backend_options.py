"""Every engine backend option a GPU deployment sets is reachable from each entry point: the Serve config file and
the KubeRay manifest (each an arg of the app), ``raymoe serve`` flags and the Serve app's args; from either it
reaches the engine's config, the ranks' ``RunnerConfig`` and the start-up bounds unchanged."""

from __future__ import annotations

from pathlib import Path

import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _serve_configs() -> dict[str, dict]:
    service = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())
    return {"serve.yaml": yaml.safe_load((CONFIGS / "serve.yaml").read_text()),
            "kuberay-rayservice.yaml": yaml.safe_load(service["spec"]["serveConfigV2"])}


BACKEND_OPTIONS = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "flash_attn", "a2a_backend": "deepep",
                   "a2a_mode": "low_latency", "num_max_dispatch_tokens_per_rank": 128, "cuda_graph_bs": (1, 8),
                   "cuda_graph_max_bs": 8, "group_schedulers": "actors", "placement_timeout_s": 600.0,
                   "load_timeout_s": 1800.0}
"""The engine backend options a GPU deployment sets (issue: reachable from ``raymoe serve``, the Serve app config and
the KubeRay manifest), with values other than their defaults."""


def test_every_engine_backend_option_reaches_the_ranks_from_each_entry_point(tiny_model, monkeypatch):
    """Each backend option is an arg of both Serve configs, a ``raymoe serve`` flag and a Serve app arg, and from
    either it reaches the engine's config, the ranks' ``RunnerConfig`` and the start-up bounds unchanged (GPU
    packages stood in for: this machine has none)."""
    from raymoe.actors.factory import runner_config_for, startup_kwargs
    from raymoe.cli import build_parser
    from raymoe.config.device_defaults import with_device
    from raymoe.deploy.cli import serve_options_from_args
    from raymoe.deploy.server_config import ServeOptions
    from raymoe.platform.cuda import flash_attn_provider

    for name, config in _serve_configs().items():
        args = config["applications"][0]["args"]
        assert set(BACKEND_OPTIONS) <= set(args), (name, set(BACKEND_OPTIONS) - set(args))
    monkeypatch.setattr("raymoe.platform.backends.module_available", lambda module: True)
    monkeypatch.setattr(flash_attn_provider, "find_flash_attn", lambda: flash_attn_provider.FlashAttnProvider(
        "double", lambda *a, **k: None, ("float16", "bfloat16"), 2))
    argv = ["serve"]
    for key, value in BACKEND_OPTIONS.items():
        argv += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, tuple) else (value,))]
    from_flags = serve_options_from_args(build_parser().parse_args(argv))
    from_args = ServeOptions(**{**BACKEND_OPTIONS, "dp_size": 4})
    for opts in (from_flags, from_args):
        values = opts.engine_option_values()
        assert {k: values[k] for k in BACKEND_OPTIONS} == BACKEND_OPTIONS
        config = with_device(opts.engine_config(tiny_model), "cuda")
        rank = runner_config_for(config)
        assert (rank.device, rank.dtype, rank.attention_backend, rank.moe_comm.a2a_backend, rank.moe_comm.a2a_mode,
                rank.max_dispatch_tokens_per_rank, rank.graph_capture_sizes) == \
            ("cuda", "bfloat16", "flash_attn", "deepep", "low_latency", 128, (1, 8))
        assert config.group_schedulers == "actors" and config.parallel.bundle_gpus
        bounds = startup_kwargs(config)
        assert (bounds["placement_timeout_s"], bounds["load_timeout_s"]) == (600.0, 1800.0)
