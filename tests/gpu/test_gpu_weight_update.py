"""Weight updates on a CUDA rank (``pytest -m gpu tests/gpu``; skipped without CUDA): CUDA graphs bind the prepared
weights by address, so an update captures them again (``GraphCapture.binds_addresses``); the greedy tokens after an
update are a fresh engine's on the new checkpoint, in float32 and with FP8 block-quantized checkpoints (whose
prepared scale layouts are made anew by the load)."""

from __future__ import annotations

import pytest
import torch

from raymoe import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["def fib(n):", "import os\nimport sys\n\n", "class Foo(object):\n    def __init__(self, x):\n"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
OPTS = {"device": "cuda", "dtype": "float32", "max_running_requests": 8, "max_context_len": 256,
        "cuda_graph_max_bs": 8}


def _tokens(engine) -> list[list[int]]:
    return [list(o.token_ids) for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("quant", [None, "fp8"], ids=["float32", "fp8"])
def test_a_cuda_update_recaptures_graphs_and_serves_the_new_weights(tmp_path, quant):
    from raymoe.models.checkpoint import make_checkpoint

    a = str(make_checkpoint("qwen3_moe", tmp_path / "a", seed=0, quant=quant))
    b = str(make_checkpoint("qwen3_moe", tmp_path / "b", seed=1, quant=quant))
    with Engine(b, **OPTS) as e:
        ref_b = _tokens(e)
    with Engine(a, **OPTS) as e:
        ref_a = _tokens(e)
        runner = e.driver.executor.worker.runner
        before = runner.graph_runner
        assert before is not None
        assert e.update_weights_from_disk(b).success
        assert runner.graph_runner is not None and runner.graph_runner is not before
        assert _tokens(e) == ref_b
        assert e.driver.num_graph_steps > 0
    assert ref_a != ref_b
