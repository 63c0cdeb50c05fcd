"""Speculative decoding on a CUDA rank (``pytest -m gpu tests/gpu``; skipped without CUDA): ngram verify steps give
the CPU engine's greedy tokens, with and without two-batch overlap (the verify rows' extend attention and the
acceptance run on the GPU, the rejected slots go back), and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from raymoe import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["for i in range(10):\n    print(i)\n" * 3, "import os\nimport sys\n" * 4, "a = 1\nb = 2\na = 1\nb =",
           "x"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
OPTS = {"dtype": "float32", "max_running_requests": 4, "max_context_len": 256, "enable_mixed_chunk": False}
SPEC = {"speculative_algorithm": "ngram", "speculative_num_steps": 3, "speculative_draft_policy": "fixed"}


@pytest.mark.parametrize("tbo", [False, True], ids=["plain", "tbo"])
def test_cuda_ngram_matches_the_cpu_engine(tiny_model, tbo):
    with Engine(tiny_model, device="cpu", **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    extra = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4} if tbo else {}
    with Engine(tiny_model, device="cuda", **OPTS, **SPEC, **extra) as e:
        outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
        spec = e.driver.group_stats()[0].spec
        report = e.driver.idle_report()
    assert outs == ref
    assert spec.verify_steps > 0 and spec.accepted_tokens > 0
    assert report.clean


def test_cuda_nextn_replays_graphs_of_the_target_and_the_mtp_layer(tmp_path):
    """``nextn`` with decode graphs on a CUDA rank: the target's graphs return the hidden states beside the logits
    (two shared outputs per CUDA graph) and the MTP layer's decode passes replay graphs of their own; the tokens are
    the CPU engine's."""
    from raymoe.models.checkpoint import make_checkpoint
    from raymoe.models.train_demo import train_checkpoint

    path = make_checkpoint("deepseek_v3", tmp_path / "ds", seed=2, num_layers=2, hidden_size=64, num_experts=8)
    train_checkpoint(path, 0.0, steps=20, seq_len=32, batch_size=4, progress=False)  # writes the MTP layer
    with Engine(str(path), device="cpu", **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    nextn = {**SPEC, "speculative_algorithm": "nextn"}
    with Engine(str(path), device="cuda", cuda_graph_max_bs=4, **OPTS, **nextn) as e:
        outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
        drafter = e.driver.executor.worker.runner.drafter
        graph_steps = e.driver.num_graph_steps
        report = e.driver.idle_report()
    assert outs == ref
    assert graph_steps > 0 and drafter.graph_passes > 0 and report.clean
