"""Device-clean forward: every architecture builds and runs extend and decode forwards with every tensor on the
``meta`` device. A tensor pinned to another device (a hard-coded ``"cpu"``) makes an op mix devices and fail,
and any host read of a device value fails too (meta tensors have no data), so this also shows the low-latency
forward needs no host sync."""

from __future__ import annotations

import pytest

from raymoe.config import GraphConfig
from raymoe.models.checkpoint import make_checkpoint
from raymoe.runner import model_runner
from raymoe.runner.model_runner import ModelRunner, RunnerConfig
from raymoe.step.forward_mode import ForwardMode
from raymoe.step.sampling_inputs import SamplingInputs
from raymoe.step.worker_batch import ModelWorkerBatch

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 300}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "mixtral"])
def arch_path(request, tmp_path_factory):
    return str(make_checkpoint(request.param, tmp_path_factory.mktemp("meta") / request.param, seed=1, **DIMS))


def _extend(capacity: int) -> ModelWorkerBatch:
    return ModelWorkerBatch(forward_mode=ForwardMode.EXTEND, input_ids=list(range(1, 8)), req_pool_indices=[0, 1],
                            seq_lens=[4, 3], prefix_lens=[0, 0], extend_lens=[4, 3], out_cache_loc=list(range(1, 8)),
                            sampling=SamplingInputs.greedy(2), dispatch_capacity=capacity)


def _decode(capacity: int) -> ModelWorkerBatch:
    return ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=[5, 6], req_pool_indices=[0, 1],
                            seq_lens=[5, 4], prefix_lens=[4, 3], extend_lens=[1, 1], out_cache_loc=[8, 9],
                            sampling=SamplingInputs.greedy(2), dispatch_capacity=capacity)


def test_forward_runs_on_the_meta_device(arch_path, monkeypatch):
    monkeypatch.setattr(model_runner, "Sampler", lambda ops, seed, device: None)  # generators cannot live on meta
    cfg = RunnerConfig(model_path=arch_path, dtype="float32", num_kv_slots=64, max_req_rows=4, max_context_len=32,
                       device="meta", graph=GraphConfig(disable_cuda_graph=True))
    runner = ModelRunner(cfg)
    tensors = [*runner.model.parameters(), *runner.model.buffers(), runner.req_to_token_pool.req_to_token]
    assert {t.device.type for t in tensors} == {"meta"}
    for batch in (_extend(8), _decode(8)):
        logits = runner.forward(runner.prepare(batch))
        assert logits.device.type == "meta" and tuple(logits.shape) == (2, DIMS["vocab_size"])


def test_a_tensor_pinned_to_cpu_is_caught(arch_path, monkeypatch):
    """The check has teeth: a rotary table left on the host fails the meta forward."""
    from raymoe.layers import rotary

    original = rotary.RotaryEmbedding.__init__

    def pinned(self, config, dtype, device=None, interleaved=False):
        original(self, config, dtype, device="cpu", interleaved=interleaved)

    monkeypatch.setattr(rotary.RotaryEmbedding, "__init__", pinned)
    monkeypatch.setattr(model_runner, "Sampler", lambda ops, seed, device: None)
    runner = ModelRunner(RunnerConfig(model_path=arch_path, dtype="float32", num_kv_slots=64, max_req_rows=4,
                                      max_context_len=32, device="meta", graph=GraphConfig(disable_cuda_graph=True)))
    with pytest.raises((RuntimeError, NotImplementedError)):
        runner.forward(runner.prepare(_decode(8)))
