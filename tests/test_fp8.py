"""FP8 checkpoints without an engine: ``quantization_config`` parsing and refusals, the writer's quantization, block
dequantization against an element-by-element reference (partial edge blocks), sharded reading on block boundaries
(TP shards, experts on EP ranks), ``modules_to_not_convert``, and the resident bytes of FP8 layers."""

from __future__ import annotations

import json

import pytest
import torch

from raymoe.comm.groups import ParallelGroups
from raymoe.config import ModelConfig
from raymoe.config_quant import Fp8Config, parse_quantization_config
from raymoe.errors import CheckpointError
from raymoe.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from raymoe.layers.moe import LocalExperts
from raymoe.models.checkpoint import make_checkpoint
from raymoe.models.fp8_checkpoint import quantize_weight
from raymoe.models.loader import CheckpointReader
from raymoe.platform.interface import BlockScales
from raymoe.platform.selector import reference_platform, select_platform

REF = reference_platform()
CPU = select_platform("cpu")
DEEPSEEK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def dequant_loop(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """The reference semantics, written out: weight [i, j] = fp8 [i, j] * scale [i // bn, j // bk]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = float(q[i, j].float()) * float(scale[i // bn, j // bk])
    return out


def _groups(tp_rank=0, tp_size=1, ep_rank=0, ep_size=1) -> ParallelGroups:
    """A rank's layout for loading only (group handles that no collective uses)."""
    if ep_size > 1:
        return ParallelGroups(world_rank=ep_rank, world_size=ep_size, dp_rank=ep_rank, dp_size=ep_size,
                              ep_rank=ep_rank, ep_size=ep_size, ep_group=object())
    return ParallelGroups(world_rank=tp_rank, world_size=tp_size, tp_rank=tp_rank, tp_size=tp_size,
                          tp_group=object() if tp_size > 1 else None)


def test_deepseek_and_qwen3_configs_parse():
    q = parse_quantization_config(DEEPSEEK_FP8)
    assert q == Fp8Config(weight_block_size=(128, 128))
    qwen = parse_quantization_config({"activation_scheme": "dynamic", "quant_method": "fp8",
                                      "weight_block_size": [128, 128],
                                      "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]})
    assert not qwen.quantizes("model.layers.0.mlp.gate") and qwen.quantizes("model.layers.0.mlp.gate_proj")
    assert not qwen.quantizes("lm_head") and qwen.quantizes("model.layers.1.mlp.gate")
    assert parse_quantization_config(None) is None
    assert parse_quantization_config({"quant_method": "fp8"}).weight_block_size is None   # per-tensor / channel


@pytest.mark.parametrize(("qc", "named"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({**DEEPSEEK_FP8, "weight_scale_dtype": "e8m0"}, "weight_scale_dtype"),
    ({**DEEPSEEK_FP8, "fmt": "e5m2"}, "fmt"),
    ({**DEEPSEEK_FP8, "activation_scheme": "static"}, "activation_scheme"),
    ({**DEEPSEEK_FP8, "weight_block_size": [128]}, "weight_block_size"),
])
def test_unsupported_quantization_is_refused_at_load_naming_it(tmp_path, qc, named):
    """A checkpoint whose quantization we do not read fails in ``ModelConfig.from_hf`` (every engine's first
    step) with a CheckpointError naming the method or field."""
    path = make_checkpoint("qwen3_moe", tmp_path / "m", num_layers=1, vocab_size=300)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_hf(path)


@pytest.mark.parametrize(("shape", "block"), [((48, 40), (32, 32)), ((576, 130), (128, 128)), ((7, 5), (3, 2))])
def test_block_quantization_round_trips_with_partial_edge_blocks(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_weight(w, "block", block)
    assert q.dtype == torch.float8_e4m3fn
    assert tuple(scale.shape) == tuple(-(-n // b) for n, b in zip(shape, block, strict=True))
    exact = dequant_loop(q, scale, *block)
    for ops in (REF, CPU):
        torch.testing.assert_close(ops.weight_values(q, BlockScales(scale, block), torch.float64), exact)
    assert (exact.float() - w).abs().max() <= w.abs().max() / 8    # e4m3: 3 mantissa bits


def test_fp8_linear_computes_on_the_dequantized_weight():
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_weight(w, "block", (16, 32))
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(2))
    expected = x.double() @ dequant_loop(q, scale, 16, 32).T
    for ops in (REF, CPU):
        prepared = ops.prepare_weight(q, None, BlockScales(scale, (16, 32)))
        torch.testing.assert_close(ops.linear(x, q, prepared).double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not cover"):
        REF.prepare_weight(q, None, BlockScales(scale[:, :1], (16, 32)))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A DeepSeek-V3 FP8 checkpoint with partial edge blocks (hidden 80 = 48 + 32, kv_a 48 + 8 = 56 rows of 32)."""
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("fp8") / "ds", num_layers=2, hidden_size=80,
                           num_experts=4, moe_intermediate_size=64, intermediate_size=128, vocab_size=300,
                           quant="fp8", fp8_block=(32, 48))


def test_tp_shards_and_ep_experts_read_their_blocks(fp8_dir):
    """Column shards (rows), row shards (columns) and local experts equal the slices of the whole dequantized
    tensor."""
    with CheckpointReader(fp8_dir) as r:
        q = Fp8Config(weight_block_size=(32, 48))
        name = "model.layers.0.mlp.gate_proj.weight"
        full = dequant_loop(r.get(name), r.get(name + "_scale_inv"), 32, 48).float()
        for rank in range(2):
            col = ColumnParallelLinear(80, [128, 128], _groups(rank, 2), torch.float32, REF, quant=q)
            col.load(r, [name, "model.layers.0.mlp.up_proj.weight"])
            assert col.weight.dtype == torch.float8_e4m3fn
            torch.testing.assert_close(col.weight_values(torch.float32)[:64], full[rank * 64:(rank + 1) * 64])
        name = "model.layers.0.mlp.down_proj.weight"                       # [80, 128], columns split by tp
        full = dequant_loop(r.get(name), r.get(name + "_scale_inv"), 32, 48).float()
        row = RowParallelLinear(128, 80, _groups(1, 2), torch.float32, REF, quant=q)
        with pytest.raises(CheckpointError, match="block boundaries"):      # columns [64, 128) cut a 48-block
            row.load(r, name)
        row4 = RowParallelLinear(128, 80, _groups(0, 4), torch.float32, REF, quant=Fp8Config((32, 32)))
        with pytest.raises(CheckpointError, match="weight_scale_inv"):      # grid of another block size
            row4.load(r, name)
        kv_a = ReplicatedLinear(80, 56, torch.float32, REF, quant=q)         # 56 rows: 32 + a partial 24
        kv_a.load(r, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
        n = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        torch.testing.assert_close(kv_a.weight_values(torch.float64),
                                   dequant_loop(r.get(n), r.get(n + "_scale_inv"), 32, 48))
        experts = LocalExperts(4, 80, 64, _groups(ep_rank=1, ep_size=2), torch.float32, REF, quant=q)
        experts.load(r, "model.layers.1.mlp.experts")
        for le, e in enumerate((2, 3)):
            p = f"model.layers.1.mlp.experts.{e}."
            gate = dequant_loop(r.get(p + "gate_proj.weight"), r.get(p + "gate_proj.weight_scale_inv"), 32, 48)
            down = dequant_loop(r.get(p + "down_proj.weight"), r.get(p + "down_proj.weight_scale_inv"), 32, 48)
            w13 = REF.weight_values(experts.w13, experts.prepared13, torch.float64)
            w2 = REF.weight_values(experts.w2, experts.prepared2, torch.float64)
            torch.testing.assert_close(w13[le, :64], gate)
            torch.testing.assert_close(w2[le], down)


def test_experts_over_fp8_weights_match_dequantized_experts(fp8_dir):
    """Every expert layout on the CPU platform over FP8 experts equals the same layout over their dequantized
    float32 copy."""
    from raymoe.platform.reference.fp8 import dense_experts

    q = Fp8Config(weight_block_size=(32, 48))
    with CheckpointReader(fp8_dir) as r:
        ex = LocalExperts(4, 80, 64, _groups(), torch.float32, CPU, quant=q)
        ex.load(r, "model.layers.1.mlp.experts")
    dense = dense_experts(ex, torch.float32)
    assert dense.w13.dtype == torch.float32 and dense is not ex
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 80, generator=g)
    ids = torch.tensor([0, 3, 1, 1, 2, 0])
    torch.testing.assert_close(CPU.expert_rows(x, ids, ex), REF.expert_rows(x, ids, dense), rtol=1e-5, atol=1e-5)
    weights = torch.rand(6, 4, generator=g)
    torch.testing.assert_close(CPU.expert_dense(x, weights, ex), REF.expert_dense(x, weights, dense),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_per_tensor_and_per_channel_checkpoints_load(tmp_path, scheme):
    path = make_checkpoint("qwen3_moe", tmp_path / scheme, num_layers=1, hidden_size=64, head_dim=16,
                           moe_intermediate_size=32, num_experts=4, vocab_size=300, quant="fp8", fp8_scheme=scheme)
    assert ModelConfig.from_hf(path).quantization == Fp8Config(weight_block_size=None)
    name = "model.layers.0.self_attn.o_proj.weight"
    with CheckpointReader(path) as r:
        stored_scale = r.get("model.layers.0.self_attn.o_proj.weight_scale")
        assert tuple(stored_scale.shape) == ((), (64, 1))[scheme == "channel"]
        o = RowParallelLinear(64, 64, _groups(), torch.float32, REF, quant=Fp8Config(weight_block_size=None))
        o.load(r, name)
        expected = r.get(name).double() * stored_scale.double()
    torch.testing.assert_close(o.weight_values(torch.float64), expected)


def test_modules_to_not_convert_stay_unquantized(tmp_path):
    skip = ("model.layers.0.self_attn.o_proj",)
    path = make_checkpoint("qwen3_moe", tmp_path / "m", num_layers=1, hidden_size=64, head_dim=16,
                           moe_intermediate_size=32, num_experts=4, vocab_size=300, quant="fp8", fp8_block=(32, 32),
                           modules_to_not_convert=skip)
    cfg = ModelConfig.from_hf(path)
    assert cfg.quantization.modules_to_not_convert == skip
    with CheckpointReader(path) as r:
        assert r.get("model.layers.0.self_attn.o_proj.weight").dtype == torch.float32
        assert r.get("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
        with pytest.raises(CheckpointError, match="float8_e4m3fn"):   # an FP8 tensor is never cast silently
            r.get("model.layers.0.self_attn.q_proj.weight", dtype=torch.float32)


def test_fp8_model_resident_weight_bytes_are_about_half(fp8_dir, tmp_path):
    """The whole DeepSeek-V3 model (quantized projections + bfloat16 rest) against the same model in bfloat16."""
    from raymoe.models.registry import get_model_class

    bf16 = make_checkpoint("deepseek_v3", tmp_path / "bf16", num_layers=2, hidden_size=80, num_experts=4,
                           moe_intermediate_size=64, intermediate_size=128, vocab_size=300)
    sizes = {}
    for name, path in (("fp8", fp8_dir), ("bf16", bf16)):
        cfg = ModelConfig.from_hf(path)
        model = get_model_class(cfg.model_type)(cfg, _groups(), torch.bfloat16, REF)
        with CheckpointReader(path) as r:
            model.load_weights(r)
        sizes[name] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        projections = [m for m in model.modules() if hasattr(m, "quant") and m.quant is not None]
        assert bool(projections) == (name == "fp8")
    assert sizes["fp8"] < 0.75 * sizes["bf16"], sizes    # embeddings and LM head stay bfloat16 in this tiny model


@pytest.mark.parametrize(("arch", "block"), [("qwen3_moe", (32, 48)), ("deepseek_v3", (32, 48)),
                                             ("deepseek_v2", (32, 48)), ("mixtral", (32, 48)),
                                             ("qwen3_moe", (128, 128)), ("deepseek_v3", (128, 128))])
def test_every_architecture_writes_and_reads_fp8(tmp_path, arch, block):
    """``make-checkpoint --quant fp8`` for each architecture: its projections are FP8 on disk and in memory, and a
    prefill gives the logits of its dequantized fp32 twin. With 128-row blocks the fused parts (q/k/v of 64 and 32
    rows, gate/up of 96 or 32) are not whole blocks and keep a scale row per weight row."""
    from fp8_twin import dequantized_twin

    from raymoe.config import GraphConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig
    from raymoe.step.forward_mode import ForwardMode
    from raymoe.step.sampling_inputs import SamplingInputs
    from raymoe.step.worker_batch import ModelWorkerBatch

    fp8 = make_checkpoint(arch, tmp_path / "fp8", num_layers=2, hidden_size=64, head_dim=16, num_experts=4,
                          moe_intermediate_size=32, intermediate_size=96, vocab_size=300, quant="fp8",
                          fp8_block=block)
    twin = dequantized_twin(fp8, tmp_path / "twin")
    prompt = [5, 9, 33, 7, 100, 41, 2]
    batch = ModelWorkerBatch(ForwardMode.EXTEND, prompt, [0], [len(prompt)], [0], [len(prompt)],
                             list(range(1, len(prompt) + 1)), [], SamplingInputs.greedy(1))
    logits = {}
    for name, path in (("fp8", fp8), ("twin", twin)):
        runner = ModelRunner(RunnerConfig(str(path), "float32", num_kv_slots=64, max_req_rows=2, max_context_len=64,
                                          graph=GraphConfig(disable_cuda_graph=True)))
        fp8_params = [n for n, p in runner.model.named_parameters() if p.dtype == torch.float8_e4m3fn]
        assert bool(fp8_params) == (name == "fp8")
        logits[name] = runner.forward(runner.prepare(batch), return_all_logits=True)
    torch.testing.assert_close(logits["fp8"], logits["twin"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("shape", "block"), [((4, 96, 80), (32, 48)), ((57, 70), (128, 128)), ((16, 16), (3, 5))])
def test_cpu_dequant_kernel_equals_the_reference(shape, block):
    """The CPU platform's one-call FP8 dequantization (a byte table) gives torch's values bit for bit, every
    e4m3fn code (NaN codes included) and partial edge blocks."""
    from raymoe.platform.cpu.kernels import cpu_ops
    from raymoe.platform.reference.fp8 import dequantize

    if not cpu_ops.enabled_for(torch.zeros(1)):
        pytest.skip("CPU kernels unavailable")
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn)
    grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    scales = BlockScales(torch.rand(grid, generator=g) + 0.5, block)
    expected = dequantize(w, scales, torch.float32)
    got = cpu_ops.fp8_dequant(w, scales.scale, block)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    torch.testing.assert_close(CPU.weight_values(w, scales, torch.float32), got, equal_nan=True)
