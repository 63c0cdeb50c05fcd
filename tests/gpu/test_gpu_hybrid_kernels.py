"""The GPU checks of hybrid models' linear-attention kernels (``pytest -m gpu tests/gpu``; skipped without CUDA,
each library's checks without it): causal-conv1d's ``causal_conv1d_fn`` / ``causal_conv1d_update`` as
``raymoe.platform.cuda.causal_conv1d`` calls them (channel-last inputs with initial and final states; the pool's
rows updated in place through int32 indices) against the strict CPU double on the same inputs. (The layers' use of
both kernels is checked on CPU through the doubles: ``tests/test_causal_conv1d.py``.)"""

from __future__ import annotations

import importlib.util

import causal_conv1d_double as ccd
import pytest
import torch

from raymoe.platform.cuda.causal_conv1d import CausalConv1dKernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_conv = pytest.mark.skipif(importlib.util.find_spec("causal_conv1d") is None, reason="needs causal_conv1d")


@needs_conv
@pytest.mark.parametrize("n", [1, 2, 37])
def test_causal_conv1d_extend_and_decode_match_the_double(n):
    real, double = CausalConv1dKernels(), CausalConv1dKernels(ccd)
    assert real.available()
    g = torch.Generator().manual_seed(n)
    c, k = 136, 4
    x, w, state = torch.randn(n, c, generator=g), torch.randn(c, k, generator=g), torch.randn(c, k - 1, generator=g)
    for init in (None, state):
        y_gpu, f_gpu = real.extend_row(x.cuda(), w.cuda().bfloat16(), None if init is None else init.cuda())
        y_cpu, f_cpu = double.extend_row(x, w.bfloat16(), init)
        torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(f_gpu.cpu(), f_cpu)
    pool = torch.randn(6, c, k - 1, generator=g)
    pool_gpu, rows = pool.cuda(), torch.tensor([4, 1, 5])
    xs = torch.randn(3, c, generator=g)
    y_gpu = real.decode(xs.cuda(), w.cuda(), pool_gpu, rows.cuda())
    y_cpu = double.decode(xs, w, pool, rows)
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool_gpu.cpu(), pool)
