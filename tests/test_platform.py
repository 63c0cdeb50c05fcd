"""The platform layer (``raymoe.platform``): the selector's choice per device, every operation of the CPU platform
against the torch reference on the same inputs, and fusions as a declared rewrite of a layer's one op list."""

from __future__ import annotations

import pytest
import torch

from raymoe.comm.expert_input import MaskedExpertRows, RoutedTokenRows
from raymoe.comm.groups import ParallelGroups
from raymoe.layers.moe import LocalExperts
from raymoe.overlap.fusion import Fusion, apply_fusions
from raymoe.overlap.operations import OpRole, YieldOperation, stage_op
from raymoe.platform.cpu.kernels import build
from raymoe.platform.selector import reference_platform, select_platform
from raymoe.step.forward_mode import ForwardMode

CPU, REF = select_platform("cpu"), reference_platform()
needs_kernels = pytest.mark.skipif(build.load() is None, reason="fused CPU kernels unavailable")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_selector_picks_one_platform_per_device():
    assert (select_platform("cpu").name, select_platform(torch.device("cpu"), torch.bfloat16).name) == ("cpu", "cpu")
    assert select_platform("cuda").name == "cuda" and select_platform("meta").name == "torch"
    assert CPU.default_tbo_decode_schedule == "coarse" and select_platform("cuda").default_tbo_decode_schedule == "fine"
    assert select_platform("cpu", torch.bfloat16).fusions() == ()  # the attention block takes float32 only
    assert REF.fusions() == () and REF.create_ep_transport(ParallelGroups.single(), "auto", 1.0) is None


@needs_kernels
def test_dense_operations_equal_the_reference():
    g = _gen(0)
    x, res, w = torch.randn(7, 64, generator=g), torch.randn(7, 64, generator=g), torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(CPU.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
    for got, want in zip(CPU.add_rms_norm(x, res, w, 1e-6), REF.add_rms_norm(x, res, w, 1e-6), strict=True):
        torch.testing.assert_close(got, want)
    weight = torch.randn(40, 64, generator=g)
    prepared = CPU.prepare_weight(torch.nn.Parameter(weight.clone(), requires_grad=False), _kind("LINEAR"))
    assert prepared is not None and REF.prepare_weight(weight, _kind("LINEAR")) is None
    torch.testing.assert_close(CPU.linear(x, weight, prepared), REF.linear(x, weight, None), rtol=1e-5, atol=1e-5)
    logits = torch.randn(9, 16, generator=g)
    for renorm, scale in ((True, 1.0), (False, 2.5)):
        (wc, ic), (wr, ir) = CPU.topk_softmax(logits, 4, renorm, scale), REF.topk_softmax(logits, 4, renorm, scale)
        assert torch.equal(ic, ir)
        torch.testing.assert_close(wc, wr)


@needs_kernels
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_equals_the_reference(with_norm, tiny_model):
    from raymoe.config import ModelConfig
    from raymoe.layers.rotary import RotaryEmbedding

    config = ModelConfig.from_hf(tiny_model)
    rotary = RotaryEmbedding(config, torch.float32)
    d, heads = config.head_dim, 6
    g = _gen(1)
    qk = torch.randn(5, heads, d, generator=g)
    norm = torch.rand(heads, d, generator=g) + 0.5 if with_norm else None
    positions = torch.tensor([0, 3, 7, 1, 30])
    want = REF.qk_norm_rope(qk.clone(), norm, 1e-6, rotary, positions)
    torch.testing.assert_close(CPU.qk_norm_rope(qk.clone(), norm, 1e-6, rotary, positions), want, rtol=1e-5,
                               atol=1e-5)


def _experts(ops, e_local: int = 4, h: int = 32, inter: int = 24) -> LocalExperts:
    ex = LocalExperts(e_local, h, inter, ParallelGroups.single(), torch.float32, ops)
    g = _gen(2)
    ex.w13.data.copy_(torch.randn(ex.w13.shape, generator=g) * 0.2)
    ex.w2.data.copy_(torch.randn(ex.w2.shape, generator=g) * 0.2)
    ex.prepared13, ex.prepared2 = (ops.prepare_weight(w, _kind("EXPERTS")) for w in (ex.w13, ex.w2))
    return ex


@needs_kernels
def test_expert_operations_equal_the_reference():
    """Every layout's operation on the CPU platform (packed grouped GEMM, fused routed kernel) gives the reference's
    rows."""
    cpu, ref = _experts(CPU), _experts(REF)
    g = _gen(3)
    x, ids = torch.randn(13, 32, generator=g), torch.randint(0, 4, (13,), generator=g)
    ends = torch.tensor([3, 3, 8, 13], dtype=torch.int32)
    for op, args in (("expert_rows", (x, ids)), ("expert_segments", (x, ends, 5)),
                     ("expert_masked", (MaskedExpertRows(torch.randn(4, 5, 32, generator=g),
                                                         torch.tensor([5, 0, 2, 4], dtype=torch.int32), 11),)),
                     ("expert_dense", (x, torch.rand(13, 4, generator=g)))):
        torch.testing.assert_close(getattr(CPU, op)(*args, cpu), getattr(REF, op)(*args, ref), rtol=1e-5, atol=1e-5)
    rows = RoutedTokenRows(torch.randn(2, 3, 32, generator=g), torch.randint(0, 6, (2, 3, 2), generator=g),
                           torch.rand(2, 3, 2, generator=g), 1)
    torch.testing.assert_close(CPU.expert_routed(rows, cpu), REF.expert_routed(rows, ref), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_sampling_equals_the_reference_at_the_same_draws():
    g = _gen(4)
    logits = torch.randn(32, 512, generator=g) * 3
    temps = torch.tensor([0.0, 0.7, 1.0, 1.5] * 8)
    uniforms = torch.rand(32, generator=g)
    assert torch.equal(CPU.greedy_argmax(logits), REF.greedy_argmax(logits))
    assert (CPU.sample_rows(logits, temps, uniforms) != REF.sample_rows(logits, temps, uniforms)).sum() <= 1
    top_ks, top_ps, min_ps = torch.tensor([0, 1, 5, 40] * 8), torch.full((32,), 0.9), torch.full((32,), 0.05)
    assert torch.equal(CPU.sample_filtered(logits, temps, top_ks, top_ps, min_ps, uniforms),
                       REF.sample_filtered(logits, temps, top_ks, top_ps, min_ps, uniforms))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_message_writes_equal_the_reference(dtype):
    src = (torch.arange(24) * 3).to(dtype).view(4, 6)[:, 1:5]  # strided: both copy it whole
    a, b = torch.zeros(200, dtype=torch.uint8), torch.zeros(200, dtype=torch.uint8)
    CPU.write_bytes(a, 16, src)
    REF.write_bytes(b, 16, src)
    assert torch.equal(a, b) and a[16:16 + src.numel() * src.element_size()].view(dtype).view(4, 4).equal(src)


def _kind(name: str):
    from raymoe.platform.interface import WeightKind

    return WeightKind[name]


@stage_op(OpRole.ATTN_INPUT_NORM)
def _norm(state) -> None:
    state.append("norm")


@stage_op(OpRole.ATTN_PREPARE)
def _prepare(state) -> None:
    state.append("prepare")


def _plain(state) -> None:
    state.append("plain")


def test_apply_fusions_replaces_matching_runs_only():
    """A run matching a pattern becomes the builder's op; a yield inside a run, a wrong order or a builder that
    declines leave the ops as they were; longer patterns listed first win."""
    fused = []

    def build(ops):
        fused.append(list(ops))
        return lambda state: state.append(f"fused{len(ops)}")

    pair = Fusion("pair", (OpRole.ATTN_INPUT_NORM, OpRole.ATTN_PREPARE), build)
    ops = [_norm, _prepare, _plain, _norm, YieldOperation(), _prepare, _prepare, _norm]
    out = apply_fusions(ops, [pair])
    assert len(out) == 7 and out[1:] == ops[2:] and len(fused) == 1
    state: list = []
    out[0](state)
    assert state == ["fused2"]
    declined = Fusion("never", (OpRole.ATTN_INPUT_NORM, OpRole.ATTN_PREPARE), lambda ops: None)
    assert apply_fusions(ops, [declined]) == ops
    with pytest.raises(ValueError, match="at least two"):
        Fusion("one", (OpRole.ATTN_CORE,), build)


@needs_kernels
def test_cpu_fusion_rewrites_the_plain_forward_only(tiny_model):
    """On a float32 CPU rank the plain forward of every Qwen3-MoE layer starts with the fused attention block
    (one op for six), the TBO schedules keep the layer's ops, and the reference platform fuses nothing (every list
    ends each layer with its ``KVLayerMark``)."""
    from raymoe.overlap.strategy import KVLayerMark
    from raymoe.platform.cpu.fusion import FusedAttnBlock
    from raymoe.runner.model_runner import ModelRunner
    from raymoe.runner.runner_config import RunnerConfig

    def runner(ops):
        return ModelRunner(RunnerConfig(tiny_model, "float32", num_kv_slots=64, max_req_rows=2, max_context_len=32,
                                        graph=_no_graphs()), ops=ops)

    model = runner(CPU).model
    per_layer = [layer.operations() for layer in model.layers]
    plain = model.schedules.plain.operations
    fused = [op for op in plain if isinstance(op, FusedAttnBlock)]
    assert len(fused) == len(model.layers)
    assert len(plain) == sum(len(ops) for ops in per_layer) - 5 * len(model.layers) + len(model.layers)  # + marks
    assert fused[0].replaced == per_layer[0][:6]
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND):
        assert not any(isinstance(op, FusedAttnBlock) for op in model.schedules.tbo(mode, "fine").operations)
    assert all(m.ops is CPU for m in model.modules() if hasattr(m, "ops"))
    reference = runner(REF).model
    assert [op for op in reference.schedules.plain.operations if not isinstance(op, KVLayerMark)] == [
        op for layer in reference.layers for op in layer.operations()]


def _no_graphs():
    from raymoe.config import GraphConfig

    return GraphConfig(disable_cuda_graph=True)
