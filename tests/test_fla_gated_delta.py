"""Qwen3.5-MoE's linear-attention layers through flash-linear-attention's kernels (``raymoe.platform.cuda.
fla_gated_delta``), on CPU through the strict double of fla's wrappers (``tests/fla_double.py``).

Checked: with the kernels in place, an extend step of three prompts (one varlen ``chunk_gated_delta_rule`` call per
layer, each sequence from its request's state), a continued chunk and decode steps (one ``fused_recurrent`` call per
layer) give the logits of the torch path within float32 rounding; the double refuses what fla refuses.
"""

from __future__ import annotations

from types import SimpleNamespace

import fla_double
import pytest
import torch
from test_deepseek_parity import _extend_batch

from raymoe.config import GraphConfig
from raymoe.models.qwen3_5_moe import GatedDeltaNetAttention
from raymoe.platform.cuda.fla_gated_delta import FlaGatedDelta
from raymoe.runner.model_runner import ModelRunner, RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch


def _runner(path: str, kernels: bool, provider=None) -> ModelRunner:
    """An eager runner on ``path``; with ``kernels`` its linear-attention layers get ``provider`` (default: fla's
    kernels over the double), as the CUDA platform hands them its kernels."""
    runner = ModelRunner(RunnerConfig(path, "float32", num_kv_slots=512, max_req_rows=4, max_context_len=128,
                                      graph=GraphConfig(disable_cuda_graph=True)))
    if kernels:
        provider = provider or SimpleNamespace(gated_delta=FlaGatedDelta(fla_double))
        for m in runner.model.modules():
            if isinstance(m, GatedDeltaNetAttention):
                m.ops = provider
    return runner


def compare_steps(torch_path: ModelRunner, kernels: ModelRunner, extends: list[ModelWorkerBatch],
                  seq: list[int], decode_steps: int = 3) -> None:
    """Run the ``extends`` (logits at every token), then ``decode_steps`` decode steps of rows 0..2 whose lengths
    start at ``seq``, on both runners; their logits agree within float32 rounding."""
    for b in extends:
        ref = torch_path.forward(torch_path.prepare(b), return_all_logits=True)
        got = kernels.forward(kernels.prepare(b), return_all_logits=True)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    for step in range(decode_steps):  # decode: one token per row, states from the pool
        seq = [n + 1 for n in seq]
        b = ModelWorkerBatch(ForwardMode.DECODE, [5 + step] * 3, [0, 1, 2], seq, [n - 1 for n in seq], [1] * 3,
                             [300 + 3 * step + r for r in range(3)], sampling=SamplingInputs.greedy(3))
        torch.testing.assert_close(kernels.forward(kernels.prepare(b)), torch_path.forward(torch_path.prepare(b)),
                                   rtol=1e-4, atol=1e-4)


def test_the_fla_kernels_give_the_torch_paths_logits(tmp_path):
    from raymoe.models.checkpoint import make_checkpoint

    path = str(make_checkpoint("qwen3_5_moe", tmp_path / "q35", seed=3, num_layers=4))
    torch_path, kernels = _runner(path, False), _runner(path, True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 70, 1)]
    first = _extend_batch([p[:n] for p, n in zip(prompts, (9, 40, 1), strict=True)])  # row 1: a first chunk
    rest = ModelWorkerBatch(ForwardMode.EXTEND, prompts[1][40:], [1], [70], [40], [30],
                            list(range(200, 230)), list(range(1 + 9, 1 + 49)), SamplingInputs.greedy(1))
    chunks, recurrent = fla_double.Calls.chunk, fla_double.Calls.recurrent
    compare_steps(torch_path, kernels, [first, rest], [9, 70, 1])
    linear_layers = sum(isinstance(m, GatedDeltaNetAttention) for m in kernels.model.modules())
    assert fla_double.Calls.chunk - chunks == 2 * linear_layers
    assert fla_double.Calls.recurrent - recurrent == 3 * linear_layers
    torch.testing.assert_close(kernels.state_pool.ssm, torch_path.state_pool.ssm, rtol=1e-4, atol=1e-5)


def test_the_double_refuses_what_fla_refuses():
    q = torch.randn(1, 6, 2, 8)
    v = torch.randn(1, 6, 4, 8)
    g, beta = -torch.rand(1, 6, 4), torch.rand(1, 6, 4)
    cu = torch.tensor([0, 2, 6])
    ok = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    fla_double.chunk_gated_delta_rule(q, q, v, g, beta, initial_state=torch.zeros(2, 4, 8, 8), **ok)
    with pytest.raises(DeprecationWarning):
        fla_double.chunk_gated_delta_rule(q, q, v, g, beta, head_first=False, **ok)
    with pytest.raises(ValueError, match="number of initial states"):
        fla_double.chunk_gated_delta_rule(q, q, v, g, beta, initial_state=torch.zeros(3, 4, 8, 8), **ok)
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        fla_double.chunk_gated_delta_rule(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                          g.expand(2, -1, -1), beta.expand(2, -1, -1), **ok)
    with pytest.raises(ValueError, match="GVA"):
        fla_double.chunk_gated_delta_rule(q, q, v[:, :, :3], g[..., :3], beta[..., :3], **ok)
    with pytest.raises(ValueError, match="rise from 0"):
        fla_double.chunk_gated_delta_rule(q, q, v, g, beta, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=torch.tensor([0, 5]))
