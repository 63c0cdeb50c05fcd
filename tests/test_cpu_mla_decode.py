"""The CPU platform's MLA decode (``raymoe.platform.cpu.mla_attention.CpuMLABackend``): absorbed decode through the
fused paged-attention kernel gives the reference backend's output, eager (widest row) and at a graph width with a
padding row, and falls back to the reference path where the kernels cannot run."""

from __future__ import annotations

import pytest
import torch
from test_mla_torch_path import _decode_case

from raymoe.attention.mla_torch_native import TorchNativeMLABackend
from raymoe.platform.cpu.kernels import build, cpu_ops
from raymoe.platform.cpu.mla_attention import KERNEL_MAX_ROWS, CpuMLABackend
from raymoe.platform.selector import select_platform

pytestmark = pytest.mark.skipif(build.load() is None, reason="the fused CPU kernels do not build here")


@pytest.mark.parametrize("graph", [False, True])
def test_kernel_decode_equals_the_reference_decode(graph, monkeypatch):
    seq_lens = [3, 300, 77, 1, 129]
    outs, calls, real = {}, [], cpu_ops.decode_attention
    monkeypatch.setattr(cpu_ops, "decode_attention", lambda *a: calls.append(a[4].tolist()) or real(*a))
    for cls in (TorchNativeMLABackend, CpuMLABackend):
        pool, rtt, q, new, fb = _decode_case(torch.float32, seq_lens)
        be = cls(rtt, pool, num_heads=4, softmax_scale=0.17, kv_chunk=64)
        if graph:
            be.init_cuda_graph_state(max_bs=8, max_kv_len=512)
            be.init_forward_metadata_replay_cuda_graph(len(seq_lens), fb.req_pool_indices, fb.seq_lens, seq_lens,
                                                       fb.forward_mode, kv_width=512)
        else:
            be.init_forward_metadata(fb)
        outs[cls] = be.forward(q, new, None, 0, fb)
        stored = pool.kv_buffer[0][fb.out_cache_loc]
    assert outs[CpuMLABackend].shape == (5, 4, 32)
    assert calls == [seq_lens]  # the kernel ran, each row over its own length (the padding row over one slot)
    assert torch.equal(stored, new)  # the new rows were stored before attending
    assert (outs[CpuMLABackend] - outs[TorchNativeMLABackend]).abs().max().item() < 1e-5


def test_the_cpu_platform_builds_it_and_other_dtypes_take_the_reference_path(monkeypatch):
    pool, rtt, q, new, fb = _decode_case(torch.bfloat16, [5, 9])
    be = select_platform(torch.device("cpu"), torch.float32).mla_attention_backend(
        "torch_native", req_to_token_pool=rtt, token_to_kv_pool=pool, num_heads=4, softmax_scale=0.2)
    assert isinstance(be, CpuMLABackend)
    calls = []
    monkeypatch.setattr(cpu_ops, "decode_attention", lambda *a: calls.append(a))
    be.init_forward_metadata(fb)
    out = be.forward(q, new, None, 0, fb)
    assert not calls and out.dtype == torch.bfloat16 and out.shape == (2, 4, 32)
    pool, rtt, q, new, fb = _decode_case(torch.float32, [4] * (KERNEL_MAX_ROWS + 1))  # a step above the cap
    be = CpuMLABackend(rtt, pool, num_heads=4, softmax_scale=0.2)
    be.init_forward_metadata(fb)
    assert be.forward(q, new, None, 0, fb).shape == (KERNEL_MAX_ROWS + 1, 4, 32) and not calls
