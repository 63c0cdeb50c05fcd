"""Overlap scheduling and MIXED batches against the transformers oracle (issue: zero-overhead scheduling).

One workload exercises what the two features could break: requests arriving while others decode (MIXED steps),
chunked prefill, radix-cache hits, retraction in a small KV pool, a stop string, and an abort in the middle of
decoding. Greedy tokens must equal transformers' with overlap scheduling on and off and MIXED on and off, on a
single rank and under dp=2 ep=2 with two-batch overlap and decode graphs; the stop string and the abort must take
effect at the same token in every mode.
"""

from __future__ import annotations

import pytest
import torch

from raymoe import Engine, SamplingParams
from raymoe.actors.driver import Driver
from raymoe.scheduler.req import FinishKind, Req

MAX_TOKENS = 24
PROMPTS = [
    "def fib(n):",
    "import os\nimport sys\n\n",
    "class Foo(object):\n    def __init__(self, x):\n        self.x = x\n",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "for i in range(10):\n    print(i)\n",
    "# Licensed under the Apache License, Version 2.0\n",
    "return self._cache[key]",
]
SHARED = ("def helper(a, b, c):\n    \"\"\"Combine three values into a tuple and return it.\"\"\"\n"
          "    return (a, b, c)\n\n")
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
STOP_PROMPT, ABORT_PROMPT = PROMPTS[4], PROMPTS[5]


@pytest.fixture(scope="module")
def oracle(tiny_model):
    """transformers greedy tokens of every prompt of the workload, and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ref = {}
    for p in PROMPTS + [SHARED + q for q in PROMPTS[:3]]:
        ids = torch.tensor([tok(p)["input_ids"]])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        ref[p] = out[0, ids.shape[1]:].tolist()
    return ref, tok


def _stop_string(tok, tokens: list[int]) -> str:
    """A stop string that first appears in the decoded text at the 7th token or later."""
    text = tok.decode(tokens, skip_special_tokens=True)
    start = len(tok.decode(tokens[:6], skip_special_tokens=True))
    for n in (3, 2, 4):
        s = text[start:start + n]
        if s.strip() and s not in tok.decode(tokens[:6], skip_special_tokens=True):
            return s
    raise AssertionError("no stop string candidate")


def run_workload(engine: Engine, oracle) -> dict[str, Req]:
    """Drive the engine's driver through the workload; returns every request by prompt (the abort included)."""
    ref, tok = oracle
    d: Driver = engine.driver
    reqs: dict[str, Req] = {}

    def add(prompt: str, params: SamplingParams = GREEDY) -> Req:
        reqs[prompt] = d.add_request(d.new_rid(), engine.encode(prompt), params)
        return reqs[prompt]

    def steps(n: int) -> None:
        for _ in range(n):
            d.step()

    add(SHARED + PROMPTS[0])  # runs alone first, so that its prefix is cached for the two below
    while d.has_unfinished():
        d.step()
    for p in PROMPTS[:3]:
        add(p)
    aborted = add(ABORT_PROMPT)
    steps(6)  # the first arrivals decode; the next ones arrive in the middle (MIXED steps when enabled)
    stop = _stop_string(tok, ref[STOP_PROMPT])
    add(STOP_PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=(stop,)))
    add(SHARED + PROMPTS[1])
    steps(3)
    while len(aborted.output_ids) < 3:
        d.step()
    at_abort = list(aborted.output_ids)
    d.abort_request(aborted.rid)
    add(SHARED + PROMPTS[2])
    add(PROMPTS[3])
    add(PROMPTS[6])
    while d.has_unfinished():
        d.step()
    assert aborted.output_ids == at_abort, "tokens were appended after the abort"
    return reqs


def check_workload(reqs: dict[str, Req], oracle) -> None:
    ref, tok = oracle
    for prompt, req in reqs.items():
        want = ref[prompt]
        got = req.output_ids
        kind = req.finished_reason.kind
        if prompt == ABORT_PROMPT:
            assert kind == FinishKind.ABORT and got == want[: len(got)] and len(got) >= 3
        elif prompt == STOP_PROMPT:
            stop = req.sampling_params.stop[0]
            assert kind == FinishKind.STOP and got == want[: len(got)], (got, want)
            assert stop in tok.decode(got, skip_special_tokens=True)
            assert stop not in tok.decode(got[:-1], skip_special_tokens=True), "stopped a token late"
        else:
            assert got == want, f"{prompt!r}: {got} != {want}"


MODES = [(True, True), (True, False), (False, True), (False, False)]
IDS = ["overlap_mixed", "overlap", "mixed", "plain"]


@pytest.mark.parametrize(("overlap", "mixed"), MODES, ids=IDS)
def test_single_rank_matches_transformers(tiny_model, oracle, overlap, mixed):
    # 140 KV slots for up to 7 sequences of ~60 tokens: decode runs short and retracts.
    with Engine(tiny_model, chunked_prefill_size=16, max_total_tokens=140, cuda_graph_max_bs=4,
                disable_overlap_schedule=not overlap, enable_mixed_chunk=mixed) as e:
        reqs = run_workload(e, oracle)
        d = e.driver
        sched = d.schedulers[0]
        check_workload(reqs, oracle)
        assert sched.num_retractions > 0 and sched.hit_tokens > 0 and d.num_graph_steps > 0
        assert (d.num_mixed_steps > 0) == mixed
        sched.check_memory_invariants()
        assert d.idle_report().clean


@pytest.mark.parametrize(("overlap", "mixed"), MODES, ids=IDS)
def test_dp2_ep2_tbo_graphs_match_transformers(ray_cluster, tiny_model, oracle, overlap, mixed):
    # Every fan-out (the step channel is the CPU default; the compiled graph keeps two steps in flight; plain actor
    # calls) and both all-to-all carriers (shared memory is the CPU default) take part.
    fanout, cpu_comm = {(True, True): ("channel", "auto"), (False, False): ("remote", "auto")}.get(
        (overlap, mixed), ("compiled", "gloo"))
    with Engine(tiny_model, dp_size=2, ep_size=2, enable_tbo=True, tbo_min_tokens_decode=2,
                tbo_min_tokens_extend=4, chunked_prefill_size=16, max_total_tokens=100, cuda_graph_max_bs=4,
                disable_overlap_schedule=not overlap, enable_mixed_chunk=mixed, fanout=fanout,
                cpu_comm=cpu_comm) as e:
        assert e.driver.executor.fanout == fanout
        reqs = run_workload(e, oracle)
        d = e.driver
        check_workload(reqs, oracle)
        assert d.num_tbo_steps > 0 and d.num_graph_steps > 0
        assert sum(s.num_retractions for s in d.schedulers) > 0 and sum(s.hit_tokens for s in d.schedulers) > 0
        assert (d.num_mixed_steps > 0) == mixed
        assert d.idle_report().clean


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral"])
def test_mixed_and_overlap_on_other_architectures_match_transformers(tmp_path, arch):
    """MLA (DeepSeek-V3) and Mixtral attention read a MIXED batch's decode rows from the ranks' table."""
    from transformers import AutoModelForCausalLM

    from raymoe.models.checkpoint import make_checkpoint

    dims = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}
    path = str(make_checkpoint(arch, tmp_path / arch, seed=3, **dims))
    prompts = [[(7 * i + 5 * j + 11) % 500 + 3 for j in range(n)] for i, n in enumerate([9, 30, 14, 41, 5])]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False)
        want.append(out[0, len(p):].tolist())
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with Engine(path, chunked_prefill_size=8, cuda_graph_max_bs=4) as e:
        d = e.driver
        reqs = [d.add_request(d.new_rid(), p, params) for p in prompts[:2]]
        for _ in range(6):
            d.step()
        reqs += [d.add_request(d.new_rid(), p, params) for p in prompts[2:]]
        while d.has_unfinished():
            d.step()
        assert d.num_mixed_steps > 0
    assert [r.output_ids for r in reqs] == want
