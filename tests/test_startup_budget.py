"""Start-up bounds derived from what a rank does before it serves: the checkpoint bytes it reads (from the
safetensors headers, checked against the tensors themselves) and the decode graphs it captures (the issue's counts:
85 at the CUDA defaults, 225 at 256 rows and a 32k context); a given ``load_timeout_s`` wins."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from raymoe.actors.startup_budget import (
    GRAPH_CAPTURE_S,
    LOAD_BASE_S,
    MIN_READ_BYTES_PER_S,
    checkpoint_bytes,
    decode_graph_count,
    startup_budget,
    weight_bytes_per_rank,
)
from raymoe.config import EngineConfig, ParallelConfig, StartupConfig, engine_config_from_options
from raymoe.config.device_defaults import with_device
from raymoe.errors import InvalidRequestError


def _tensor_bytes(folder: str) -> tuple[int, int]:
    """(expert, other) bytes by reading every tensor (the oracle for the header arithmetic)."""
    expert = other = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                n = t.numel() * t.element_size()
                if ".experts." in name:
                    expert += n
                else:
                    other += n
    return expert, other


def test_checkpoint_bytes_from_headers_match_the_tensors(tiny_model, tmp_path):
    expert, other = checkpoint_bytes(tiny_model)
    assert (expert, other) == _tensor_bytes(tiny_model) and expert > 0 and other > 0
    broken = tmp_path / "model.safetensors"
    for body in (b"\xff" * 64, b"\x02" + b"\x00" * 7 + b"[]", b"\x02" + b"\x00" * 7 + b"{}" + b"\x00" * 6, b"\x01"):
        broken.write_bytes(body)  # a length past the file, JSON that is no header, an empty header, too short
        assert checkpoint_bytes(tmp_path) == ((0, 0) if body[8:10] == b"{}" else (0, len(body))), body


def test_each_rank_reads_its_share_of_the_experts(tiny_model):
    expert, other = checkpoint_bytes(tiny_model)
    assert weight_bytes_per_rank(tiny_model, ParallelConfig()) == expert + other
    for parallel in (ParallelConfig(dp_size=2, ep_size=2), ParallelConfig(tp_size=2, dp_size=1, ep_size=1)):
        assert weight_bytes_per_rank(tiny_model, parallel) == other + -(-expert // 2)


def test_decode_graph_count_follows_buckets_tbo_and_kv_widths(monkeypatch):
    from raymoe.platform.cuda import flash_attn_provider

    monkeypatch.setattr("raymoe.platform.backends.module_available", lambda module: True)  # no vLLM here
    monkeypatch.setattr(flash_attn_provider, "find_flash_attn", lambda: flash_attn_provider.FlashAttnProvider(
        "double", lambda *a, **k: None, ("float16", "bfloat16"), 2))

    def count(device: str, **options) -> int:
        config = engine_config_from_options("/m", {"dp_size": 2, "ep_size": 2, **options})
        return decode_graph_count(with_device(config, device))

    assert count("cuda") == 85  # (9 buckets up to 64 rows + 8 TBO variants of >= 2 rows) x 5 KV widths to 2048
    assert count("cuda", max_running_requests=256, max_context_len=32768) == 225
    assert count("cuda", enable_tbo=False) == 9 * 5
    assert count("cuda", attention_backend="flash_attn") == 17  # reads up to seqused_k: one width
    assert count("cpu") == 9  # CPU recordings keep one width; TBO off on CPU ranks
    assert count("cuda", disable_cuda_graph=True) == 0


def test_load_bound_is_derived_unless_given(tiny_model):
    config = with_device(EngineConfig(model=tiny_model, parallel=ParallelConfig(dp_size=2, ep_size=2)), "cuda")
    budget = startup_budget(config)
    weights, graphs = weight_bytes_per_rank(tiny_model, config.parallel), decode_graph_count(config)
    assert budget.derived and (budget.weight_bytes_per_rank, budget.decode_graphs) == (weights, graphs)
    derived = LOAD_BASE_S + weights / MIN_READ_BYTES_PER_S + graphs * GRAPH_CAPTURE_S["cuda"]
    assert budget.load_s == pytest.approx(derived)
    assert budget.engine_s > budget.placement_s + budget.load_s
    given = with_device(EngineConfig(model=tiny_model, startup=StartupConfig(placement_timeout_s=30,
                                                                             load_timeout_s=45)), "cpu")
    fixed = startup_budget(given)
    assert (fixed.placement_s, fixed.load_s, fixed.derived) == (30, 45, False)
    for bad in (0, -1, float("inf"), True):
        with pytest.raises(InvalidRequestError, match="load_timeout_s"):
            StartupConfig(load_timeout_s=bad)
    with pytest.raises(InvalidRequestError, match="placement_timeout_s"):
        StartupConfig(placement_timeout_s=None)
