"""How long an engine's start-up may take: bounds derived from what its ranks do before they serve.

A rank's start after placement is dominated by two things the config and the checkpoint tell in advance: reading
its share of the weights, and capturing its decode graphs (buckets x TBO modes x KV widths: 85 at the defaults on
CUDA, 225 at 256 rows and a 32k context). :func:`startup_budget` turns them into the bound ``RayExecutor`` waits for
loading and capturing (``StartupConfig.load_timeout_s`` when set) and the bound the front end waits for the whole
engine. The constants are deliberately slow rates: the bounds exist to turn a hung start into an error, not to
predict a start's duration.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from raymoe.config import EngineConfig, ParallelConfig
from raymoe.runner.graph_buckets import capture_sizes, kv_width_ladder

LOAD_BASE_S = 120.0
"""Seconds of a rank's load that do not scale with weights or graphs: its process and imports, building the model,
allocating KV pools, building the CPU kernels once."""

MIN_READ_BYTES_PER_S = 100 * 2**20
"""Slowest weight read (bytes per second per rank) the derived bound waits for: a network volume shared by the
ranks of a node."""

GRAPH_CAPTURE_S = {"cuda": 5.0, "cpu": 1.0}
"""Seconds per decode graph (its warm-up runs and capture) the derived bound allows, by device."""

RENDEZVOUS_S = 180.0
"""Bound on joining the process groups and opening the step channels, seconds (``RayExecutor.init_timeout_s``)."""

DRIVER_SLACK_S = 120.0
"""What the front end allows beyond the ranks' stages: the driver actor's own start, tokenizer, channels and DP
group processes, seconds."""

EXPERT_MARKER = ".experts."
"""Tensors whose name contains this are routed experts (Qwen3-MoE, DeepSeek ``mlp.experts.E.``, Mixtral
``block_sparse_moe.experts.E.``): each rank reads ``1/ep`` of them (``1/tp`` with ``ep_size=1``)."""


@dataclass(frozen=True)
class StartupBudget:
    """Start-up bounds of one engine, seconds.

    Attributes:
        placement_s: wait for the placement groups (``StartupConfig.placement_timeout_s``).
        load_s: each rank's weights and decode graphs together (given or derived).
        weight_bytes_per_rank: checkpoint bytes one rank reads, at most (on-disk dtype).
        decode_graphs: decode graphs one rank captures.
        derived: ``load_s`` was derived (``load_timeout_s`` None).
    """

    placement_s: float
    load_s: float
    weight_bytes_per_rank: int
    decode_graphs: int
    derived: bool

    @property
    def engine_s(self) -> float:
        """How long the front end waits for the whole engine to be ready, seconds."""
        return self.placement_s + RENDEZVOUS_S + self.load_s + DRIVER_SLACK_S


def checkpoint_bytes(model_path: str | Path) -> tuple[int, int]:
    """``(expert_bytes, other_bytes)`` of the tensors in the folder's ``*.safetensors`` files, from their headers
    (8-byte little-endian header length, then JSON with each tensor's ``data_offsets``; no tensor is read).
    A file whose header does not parse (too short, a length past the file, not JSON, entries without offsets)
    counts as its size in other bytes (the loader reports it)."""
    expert = other = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        sizes = _header_sizes(file)
        if sizes is None:
            other += file.stat().st_size if file.exists() else 0
            continue
        expert += sizes[0]
        other += sizes[1]
    return expert, other


def _header_sizes(file: Path) -> tuple[int, int] | None:
    """``(expert_bytes, other_bytes)`` of one safetensors file's header, None when it does not parse."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > file.stat().st_size - 8:
                return None
            header = json.loads(f.read(n))
        expert = other = 0
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if EXPERT_MARKER in name:
                expert += end - begin
            else:
                other += end - begin
        return expert, other
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError):
        return None


def weight_bytes_per_rank(model_path: str | Path, parallel: ParallelConfig) -> int:
    """Checkpoint bytes one rank reads, at most: every non-expert tensor (replicated or TP-sharded: counted whole)
    plus its share of the experts (``1/ep_size``, or ``1/tp_size`` when experts are tensor-parallel)."""
    expert, other = checkpoint_bytes(model_path)
    share = parallel.ep_size if parallel.ep_size > 1 else parallel.tp_size
    return other + -(-expert // share)


def decode_graph_count(config: EngineConfig) -> int:
    """Decode graphs one rank of the resolved ``config`` captures: per bucket one, plus one TBO variant of every
    bucket of at least 2 rows when TBO is on, each at every KV width of the ladder on CUDA with a paged-SDPA
    backend (``raymoe.runner.graph_runner``; flash_attn reads up to ``seqused_k`` and keeps one width, CPU
    recordings narrow on replay)."""
    if config.graph.disable_cuda_graph:
        return 0
    sizes = capture_sizes(config.scheduler.max_running_requests, config.graph.cuda_graph_bs,
                          config.graph.cuda_graph_max_bs)
    per_width = len(sizes) + (sum(1 for bs in sizes if bs >= 2) if config.overlap.enable_tbo else 0)
    widths = 1
    if config.device == "cuda" and config.attention_backend == "torch_native":
        widths = len(kv_width_ladder(config.cache.max_context_len, config.graph.cuda_graph_min_kv_width))
    return per_width * widths


def startup_budget(config: EngineConfig) -> StartupBudget:
    """The start-up bounds of the resolved ``config`` (module docstring); ``load_timeout_s`` when given, else
    ``LOAD_BASE_S + weight_bytes_per_rank / MIN_READ_BYTES_PER_S + decode_graphs * GRAPH_CAPTURE_S[device]``."""
    weights = weight_bytes_per_rank(config.model, config.parallel)
    graphs = decode_graph_count(config)
    given = config.startup.load_timeout_s
    load = given if given is not None else (
        LOAD_BASE_S + weights / MIN_READ_BYTES_PER_S + graphs * GRAPH_CAPTURE_S.get(config.device, 5.0))
    return StartupBudget(config.startup.placement_timeout_s, float(load), weights, graphs, given is None)
