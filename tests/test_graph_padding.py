"""Padding rows of a decode graph's bucket carry no expert: the MoE layer gives them ``NO_EXPERT`` ids and weight 0
(``ForwardBatch.padding_mask``), and every dispatch mode hands the experts exactly the real rows' pairs, while the
real rows' outputs stay those of the batch without padding. At ep = 1 here (normal mode, the torch low-latency
layout, the CPU token rows, the CUDA experts over the grouped-GEMM double); the DeepEP double at ep = 2 in
``test_deepep_graphs.py``."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from cuda_stream_double import CudaStreamDouble  # noqa: E402
from grouped_mm_double import StrictGroupedMm  # noqa: E402

from raymoe.comm.expert_input import (  # noqa: E402
    NO_EXPERT,
    DenseExpertRows,
    ExpertRows,
    GroupedExpertRows,
    MaskedExpertRows,
    RoutedTokenRows,
)
from raymoe.comm.groups import ParallelGroups  # noqa: E402
from raymoe.layers.moe import SparseMoeBlock  # noqa: E402
from raymoe.platform.cuda.platform import CudaPlatform  # noqa: E402
from raymoe.platform.selector import reference_platform, select_platform  # noqa: E402

E, K, H, INTER = 8, 2, 64, 32


def routed_pairs(rows, num_local: int, first_expert: int = 0) -> int:
    """How many (token, expert) pairs a dispatch handed this rank's experts, in any layout."""
    if isinstance(rows, ExpertRows):
        return int((rows.local_ids >= 0).sum())
    if isinstance(rows, GroupedExpertRows):
        return int(rows.ends[-1])
    if isinstance(rows, MaskedExpertRows):
        return int(rows.counts.sum())
    if isinstance(rows, RoutedTokenRows):
        return int(((rows.topk_ids >= first_expert) & (rows.topk_ids < first_expert + num_local)).sum())
    if isinstance(rows, DenseExpertRows):
        return int((rows.weights != 0).sum())
    raise TypeError(type(rows))


class RecordingDispatcher:
    """Wraps a MoE layer's dispatcher: records the top-k ids each dispatch was given, and each dispatch's answer's
    layout and routed pairs."""

    def __init__(self, inner, num_local: int, first_expert: int):
        self.inner, self.num_local, self.first_expert = inner, num_local, first_expert
        self.ids: list[torch.Tensor] = []
        self.answers: list[tuple[str, int]] = []

    def dispatch_a(self, hidden, topk_ids, topk_weights, capacity=None):
        self.ids.append(topk_ids.clone())
        return self.inner.dispatch_a(hidden, topk_ids, topk_weights, capacity)

    def dispatch_b(self, handle):
        rows = self.inner.dispatch_b(handle)
        self.answers.append((type(rows).__name__, routed_pairs(rows, self.num_local, self.first_expert)))
        return rows

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _SeededReader:
    """A checkpoint reader over seeded tensors (the names a ``SparseMoeBlock`` loads)."""

    def __init__(self, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        self.tensors = {"moe.gate.weight": torch.randn(E, H, generator=g)}
        for e in range(E):
            for part, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
                self.tensors[f"moe.experts.{e}.{part}.weight"] = torch.randn(*shape, generator=g) * 0.2
        self.dtype = dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.tensors[name].to(dtype)

    def get_slice(self, name: str, dim: int, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return self.tensors[name].narrow(dim, start, end - start).to(dtype)


def _block(ops, dtype: torch.dtype) -> SparseMoeBlock:
    block = SparseMoeBlock(E, K, H, INTER, True, ParallelGroups.single(), dtype, ops)
    block.load(_SeededReader(dtype), "moe")
    block.a2a = RecordingDispatcher(block.a2a, E, 0)
    return block


def _run(block: SparseMoeBlock, x: torch.Tensor, capacity: int | None, padding: torch.Tensor | None) -> torch.Tensor:
    state = SimpleNamespace(hidden_states=x, forward_batch=SimpleNamespace(dispatch_capacity=capacity,
                                                                           padding_mask=padding))
    for op in block.operations():
        op(state)
    return state.moe_output


MODES = {  # name: (platform, dtype, capacity, layout the experts get)
    "normal": (reference_platform(), torch.float32, None, "ExpertRows"),
    "low_latency": (reference_platform(), torch.float32, 4, "GroupedExpertRows"),
    "cpu_token_rows": (select_platform("cpu"), torch.float32, 4, "RoutedTokenRows"),
    "cuda_low_latency": (CudaPlatform(grouped_gemm=StrictGroupedMm(), cuda_api=CudaStreamDouble()), torch.bfloat16,
                         4, "GroupedExpertRows"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_padded_batch_dispatches_exactly_the_real_rows_routes(mode):
    """A bucket of 4 with 3 real rows: the padding row goes out with NO_EXPERT ids, the experts get the 3 real
    rows' 6 pairs (not 8), the real rows' outputs equal the unpadded batch's and the padding row's is 0."""
    ops, dtype, capacity, layout = MODES[mode]
    block = _block(ops, dtype)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    padding = torch.tensor([False, False, False, True])
    out = _run(block, x, capacity, padding)
    ids = block.a2a.ids[-1]
    assert bool((ids[3] == NO_EXPERT).all()) and bool((ids[:3] >= 0).all())
    assert block.a2a.answers[-1] == (layout, 3 * K)
    assert bool((out[3] == 0).all())
    alone = _run(block, x[:3], capacity, None)
    assert block.a2a.answers[-1] == (layout, 3 * K)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out[:3], alone, **tol)
    everything = _run(block, x, capacity, torch.zeros(4, dtype=torch.bool))  # no padding: all 8 pairs
    assert block.a2a.answers[-1] == (layout, 4 * K) and not bool((everything[3] == 0).all())


@pytest.mark.parametrize("a2a_mode", ["auto", "low_latency"])
def test_replayed_graph_dispatches_only_real_rows(tiny_model, a2a_mode):
    """A CPU decode graph (recorded forward) of bucket 4 replaying 3 rows, then an IDLE bucket: every MoE layer
    dispatches the padding rows with NO_EXPERT ids and hands its experts 3 * k pairs, then none."""
    from dataclasses import replace

    from test_graph_runner import _decode, _prefill

    from raymoe.config import GraphConfig, MoeCommConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig
    from raymoe.step.worker_batch import ModelWorkerBatch

    cfg = RunnerConfig(tiny_model, "float32", num_kv_slots=8 * 48, max_req_rows=8, max_context_len=48,
                       graph=GraphConfig(cuda_graph_max_bs=4), moe_comm=MoeCommConfig("torch", a2a_mode, 8))
    runner = ModelRunner(cfg)
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.a2a = RecordingDispatcher(block.a2a, block.experts.num_local, block.experts.expert_start)
    runner.forward(runner.prepare(_prefill([0, 1, 2])))
    top_k = blocks[0].top_k
    for batch, real in ((_decode([0, 1, 2], graph_bs=4), 3), (replace(ModelWorkerBatch.idle(), graph_bs=4), 0)):
        fb = runner.prepare(batch, for_graph=True)
        assert runner.graph_runner.can_run(fb)
        runner.graph_runner.replay(fb)
        for block in blocks:
            ids = block.a2a.ids[-1]
            assert ids.shape == (4, top_k) and bool((ids[real:] == NO_EXPERT).all()) and bool((ids[:real] >= 0).all())
            assert block.a2a.answers[-1][1] == real * top_k
