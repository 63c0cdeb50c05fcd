"""Hybrid models' causal conv through the causal-conv1d library (``raymoe.platform.cuda.causal_conv1d``), on CPU
through the strict double of the library (``tests/causal_conv1d_double.py``), with fla's double for the delta rule
as the CUDA platform hands both to the layers.

Checked: an extend step of three prompts (fresh rows through ``causal_conv1d_fn`` without initial states, one row a
first chunk), a continued chunk (its initial states from the pool) and decode steps (one in-place
``causal_conv1d_update`` per layer through ``conv_state_indices``) give the torch path's logits and conv states;
the decode kernel touches only the rows it is pointed at; the layer keeps the torch path for channel counts the
library's channel-last layout refuses; the double refuses what the library refuses.
"""

from __future__ import annotations

from types import SimpleNamespace

import causal_conv1d_double as ccd
import fla_double
import pytest
import torch
from test_deepseek_parity import _extend_batch
from test_fla_gated_delta import _runner as fla_runner
from test_fla_gated_delta import compare_steps

from raymoe.models.qwen3_5_moe import GatedDeltaNetAttention
from raymoe.platform.cuda.causal_conv1d import CausalConv1dKernels
from raymoe.platform.cuda.fla_gated_delta import FlaGatedDelta
from raymoe.runner.model_runner import ModelRunner
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch


def _runner(path: str, kernels: bool) -> ModelRunner:
    provider = SimpleNamespace(gated_delta=FlaGatedDelta(fla_double), causal_conv1d=CausalConv1dKernels(ccd))
    return fla_runner(path, kernels, provider)


def test_the_kernels_give_the_torch_paths_logits_and_states(tmp_path):
    from raymoe.models.checkpoint import make_checkpoint

    path = str(make_checkpoint("qwen3_5_moe", tmp_path / "q35", seed=4, num_layers=3))
    torch_path, kernels = _runner(path, False), _runner(path, True)
    conv_dim = next(m for m in kernels.model.modules() if isinstance(m, GatedDeltaNetAttention)).cfg.conv_dim
    assert conv_dim % 8 == 0  # the channel-last layout the kernels need
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 42, 1)]
    first = _extend_batch([p[:n] for p, n in zip(prompts, (9, 40, 1), strict=True)])  # row 1: a first chunk
    rest = ModelWorkerBatch(ForwardMode.EXTEND, prompts[1][40:], [1], [42], [40], [2],  # 2 < K-1 new inputs
                            list(range(200, 202)), list(range(1 + 9, 1 + 49)), SamplingInputs.greedy(1))
    fn, update = ccd.Calls.fn, ccd.Calls.update
    compare_steps(torch_path, kernels, [first, rest], [9, 42, 1])
    linear_layers = sum(isinstance(m, GatedDeltaNetAttention) for m in kernels.model.modules())
    assert ccd.Calls.fn - fn == 4 * linear_layers  # three rows, then one
    assert ccd.Calls.update - update == 3 * linear_layers
    rows = slice(0, 3)
    torch.testing.assert_close(kernels.state_pool.conv[:, rows], torch_path.state_pool.conv[:, rows])
    torch.testing.assert_close(kernels.state_pool.ssm[:, rows], torch_path.state_pool.ssm[:, rows], rtol=1e-4,
                               atol=1e-5)


def test_decode_updates_only_the_rows_it_is_pointed_at():
    kernels = CausalConv1dKernels(ccd)
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(6, 16, 3, generator=g)
    weight = torch.randn(16, 4, generator=g)
    x = torch.randn(2, 16, generator=g)
    before = pool.clone()
    y = kernels.decode(x, weight, pool, torch.tensor([4, 1]))
    for i, row in enumerate((4, 1)):
        full = torch.cat([before[row], x[i, :, None]], dim=1)  # [C, K]
        torch.testing.assert_close(y[i], torch.nn.functional.silu((full * weight).sum(-1)))
        torch.testing.assert_close(pool[row], full[:, 1:])
    untouched = [0, 2, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])


def test_the_layer_keeps_torch_for_what_the_library_refuses(tmp_path):
    """A layer whose conv channels the channel-last layout refuses (not a multiple of 8) takes the torch path."""
    import dataclasses

    from raymoe.models.checkpoint import make_checkpoint

    layer = next(m for m in _runner(str(make_checkpoint("qwen3_5_moe", tmp_path / "q", seed=1, num_layers=3)),
                                    True).model.modules() if isinstance(m, GatedDeltaNetAttention))
    assert layer._conv_kernel() is layer.ops.causal_conv1d
    layer.cfg = dataclasses.replace(layer.cfg, value_head_dim=layer.cfg.value_head_dim + 1)  # conv_dim + Hv
    assert layer.cfg.conv_dim % 8 and layer._conv_kernel() is None
    assert CausalConv1dKernels.supports(136, 4) and not CausalConv1dKernels.supports(132, 4)
    assert not CausalConv1dKernels.supports(64, 5) and not CausalConv1dKernels.supports(64, 1)
    try:
        import causal_conv1d  # noqa: F401
    except ImportError:
        assert not CausalConv1dKernels().available()  # imported on first use: missing -> the torch path
    assert CausalConv1dKernels(ccd).available()


def test_the_double_refuses_what_the_library_refuses():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 4, generator=g)
    x_last = torch.randn(1, 5, 16, generator=g).transpose(1, 2)  # [1, 16, 5], channel stride 1
    init = torch.randn(1, 3, 16, generator=g).transpose(1, 2)
    ccd.causal_conv1d_fn(x_last, w, initial_states=init, return_final_states=True, activation="silu")
    with pytest.raises(NotImplementedError):
        ccd.causal_conv1d_fn(x_last, w, activation="gelu")
    with pytest.raises(RuntimeError, match="width between 2 and 4"):
        ccd.causal_conv1d_fn(x_last, torch.randn(16, 5))
    with pytest.raises(RuntimeError, match="channel last layout"):  # channel-first x with initial states
        ccd.causal_conv1d_fn(x_last.contiguous(), w, initial_states=init)
    with pytest.raises(RuntimeError, match="divisible by 8"):
        ccd.causal_conv1d_fn(torch.randn(1, 5, 12).transpose(1, 2), torch.randn(12, 4))
    with pytest.raises(RuntimeError, match="channel stride 1"):
        ccd.causal_conv1d_fn(x_last, w, initial_states=init.contiguous())
    with pytest.raises(RuntimeError, match="input's dtype"):
        ccd.causal_conv1d_fn(x_last, w, initial_states=init.double().float().to(torch.bfloat16))
    state = torch.zeros(4, 16, 3)
    ccd.causal_conv1d_update(torch.randn(2, 16), state, w, activation="silu",
                             conv_state_indices=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        ccd.causal_conv1d_update(torch.randn(2, 16), state, w, conv_state_indices=torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="input's dtype"):
        ccd.causal_conv1d_update(torch.randn(2, 16, dtype=torch.bfloat16), state, w,
                                 conv_state_indices=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="batch_size"):  # no indices: the state batch must be the input's
        ccd.causal_conv1d_update(torch.randn(2, 16), state, w)
