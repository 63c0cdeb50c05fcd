"""The GPU suite (``pytest -m gpu tests/gpu``; skipped without CUDA): a CUDA rank gives the CPU engine's greedy
tokens with decode graphs (CUDA graphs, low-latency MoE dispatch) on and off and two-batch overlap on and off, also
while decoding crosses the KV widths of the graph ladder; a narrow graph reads only its width of the table; its
prefill logits match transformers on the same GPU."""

from __future__ import annotations

import pytest
import torch

from raymoe import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["def fib(n):", "import os\nimport sys\n\n", "class Foo(object):\n    def __init__(self, x):\n",
           "The quick brown fox jumps over the lazy dog. " * 2, "x", "return self._cache[key]",
           "for i in range(10):\n    print(i)\n", "# Licensed under the Apache License, Version 2.0\n"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
OPTS = {"dtype": "float32", "max_running_requests": 8, "chunked_prefill_size": 64, "max_context_len": 256,
        "cuda_graph_max_bs": 8}  # float32 on both devices: dtype auto would be bfloat16 on CUDA
TBO = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}


@pytest.fixture(scope="module")
def cpu_tokens(tiny_model):
    with Engine(tiny_model, device="cpu", **OPTS) as e:
        return [o.token_ids for o in e.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager"])
@pytest.mark.parametrize("tbo", [False, True], ids=["plain", "tbo"])
@pytest.mark.parametrize("a2a_mode", ["auto", "normal"])
def test_cuda_engine_matches_cpu_engine(tiny_model, cpu_tokens, graphs, tbo, a2a_mode):
    if graphs and a2a_mode == "normal":
        pytest.skip("normal-mode MoE shapes depend on the routing: not capturable in a CUDA graph")
    with Engine(tiny_model, device="cuda", disable_cuda_graph=not graphs, a2a_mode=a2a_mode, **OPTS,
                **(TBO if tbo else {})) as e:
        runner = e.driver.executor.worker.runner
        assert runner.device.type == "cuda"
        assert {p.device.type for p in runner.model.parameters()} == {"cuda"}
        outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
        graph_steps, tbo_steps = e.driver.num_graph_steps, e.driver.num_tbo_steps
    assert (graph_steps > 0) == graphs
    assert (tbo_steps > 0) == tbo
    assert outs == cpu_tokens


def test_cuda_prefill_logits_match_transformers(tiny_model):
    from transformers import AutoModelForCausalLM

    from raymoe.config import GraphConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig
    from raymoe.step.forward_mode import ForwardMode
    from raymoe.step.sampling_inputs import SamplingInputs
    from raymoe.step.worker_batch import ModelWorkerBatch
    from raymoe.tokenizer import load_tokenizer

    ids = load_tokenizer(tiny_model).encode(PROMPTS[2], add_special_tokens=False)
    runner = ModelRunner(RunnerConfig(model_path=tiny_model, dtype="float32", num_kv_slots=256, max_req_rows=2,
                                      max_context_len=128, device="cuda", graph=GraphConfig(disable_cuda_graph=True)))
    batch = ModelWorkerBatch(forward_mode=ForwardMode.EXTEND, input_ids=ids, req_pool_indices=[0],
                             seq_lens=[len(ids)], prefix_lens=[0], extend_lens=[len(ids)],
                             out_cache_loc=list(range(1, len(ids) + 1)), sampling=SamplingInputs.greedy(1))
    ours = runner.forward(runner.prepare(batch), return_all_logits=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)


def test_bfloat16_cuda_graphs_run(tiny_model):
    with Engine(tiny_model, device="cuda", **{**OPTS, "dtype": "bfloat16"}) as e:
        outs = e.generate(PROMPTS, GREEDY)
        assert e.driver.num_graph_steps > 0
    assert all(len(o.token_ids) > 0 for o in outs)


# Decode graphs at several KV widths: max_context_len 512 gives the ladder 128, 256, 512 (tokens); 200 tokens past
# the short prompts cross 128 while decoding, so steps replay the 128 graphs, then wider ones.
WIDE = {**OPTS, "max_context_len": 512}
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cpu_long_tokens(tiny_model):
    with Engine(tiny_model, device="cpu", **WIDE) as e:
        return [o.token_ids for o in e.generate(PROMPTS, LONG)]


@pytest.mark.parametrize("tbo", [False, True], ids=["plain", "tbo"])
def test_cuda_graph_kv_widths_match_cpu_engine(tiny_model, cpu_long_tokens, tbo):
    with Engine(tiny_model, device="cuda", **WIDE, **(TBO if tbo else {})) as e:
        graphs = e.driver.executor.worker.runner.graph_runner
        assert graphs.kv_widths == [128, 256, 512]
        assert {w for _, _, w in graphs.graphs} == {128, 256, 512}
        outs = [o.token_ids for o in e.generate(PROMPTS, LONG)]
        assert e.driver.num_graph_steps > 0
        replayed = {w for w, n in graphs.replayed_widths.items() if n}
    assert 128 in replayed and len(replayed) > 1, graphs.replayed_widths  # a width boundary was crossed
    assert outs == cpu_long_tokens


def test_cuda_graph_reads_only_its_kv_width(tiny_model):
    """A graph captured at width 16 reads only the first 16 table columns: columns 16.. of every row point at a
    slot whose keys/values are NaN, so a graph attending over more columns (the full-width control, same inputs)
    gives NaN logits (masked NaN keys/values still poison SDPA), while the 16-wide one equals eager."""
    from raymoe.config import GraphConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig
    from raymoe.step.forward_mode import ForwardMode
    from raymoe.step.sampling_inputs import SamplingInputs
    from raymoe.step.worker_batch import ModelWorkerBatch

    rows, ctx, prompt = 4, 64, 5
    poison = rows * ctx  # last KV slot, never handed out below

    def logits(min_kv_width):
        runner = ModelRunner(RunnerConfig(model_path=tiny_model, dtype="float32", num_kv_slots=rows * ctx,
                                          max_req_rows=rows, max_context_len=ctx, device="cuda",
                                          graph=GraphConfig(cuda_graph_bs=(1, 2, 4),
                                                            cuda_graph_min_kv_width=min_kv_width)))
        ids = [(7 * r + i) % 500 + 10 for r in range(rows) for i in range(prompt)]
        lens = [prompt] * rows
        runner.forward(runner.prepare(ModelWorkerBatch(
            ForwardMode.EXTEND, ids, list(range(rows)), lens, [0] * rows, lens,
            [1 + r * ctx + i for r in range(rows) for i in range(prompt)], sampling=SamplingInputs.greedy(rows))))
        for buf in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer:
            buf[poison] = float("nan")
        runner.req_to_token_pool.req_to_token[:rows, 16:] = poison
        step = ModelWorkerBatch(ForwardMode.DECODE, [3 + r for r in range(rows)], list(range(rows)),
                                [prompt + 1] * rows, lens, [1] * rows, [1 + r * ctx + prompt for r in range(rows)],
                                sampling=SamplingInputs.greedy(rows), graph_bs=4)
        eager = runner.forward(runner.prepare(step)).clone()
        graphs = runner.graph_runner
        graph = graphs.replay(runner.prepare(step, for_graph=True)).clone()
        torch.cuda.synchronize()
        return eager, graph, graphs

    eager, narrow, graphs = logits(16)
    assert graphs.kv_widths == [16, 32, 64] and graphs.replayed_widths[16] == 1
    assert torch.isfinite(eager).all() and torch.isfinite(narrow).all()
    torch.testing.assert_close(narrow, eager, rtol=1e-3, atol=1e-3)
    _, full, graphs = logits(None)
    assert graphs.kv_widths == [64] and graphs.replayed_widths[64] == 1
    assert not torch.isfinite(full).all(), "control: a 64-wide graph must read the poisoned columns"
