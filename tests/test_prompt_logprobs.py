"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``; ``raymoe.step.prompt_scores``): every prompt token
after the first gets transformers' log-softmax score and top-k, whatever the engine does around the request:
chunked prefill and MIXED steps (a chunk's last position scores the next chunk's first token), radix-cache hits
(a scored request computes its prompt in full; a plain one beside it still hits), retraction (a prompt computed
twice keeps one score per token), ``nextn`` speculation (the drafting path computes the logits), dp=2 ep=2 with
two-batch overlap, and a PD pair (the prefill instance scores; the answer crosses the front-end channel). The
generated tokens stay those of plain requests, and nothing leaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raymoe import Engine, SamplingParams
from raymoe.errors import InvalidRequestError
from raymoe.models.checkpoint import make_checkpoint
from raymoe.scheduler.req import Req
from raymoe.step.prompt_scores import PromptScoreRow

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}
PROMPTS = ["for i in range(10):\n    print(i)\n" * 3, "hello hello hello world", "import os\nimport sys\n" * 4, "x y"]
N = 6
K = 3
OPTS = {"max_running_requests": 8, "max_context_len": 160, "cuda_graph_max_bs": 8, "dtype": "float32"}  # (fp32 oracle)
PLAIN = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
SCORED = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, prompt_logprobs=K)


def _hf_scores(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """transformers' log-prob of each prompt token after the first, the top-K ids before each, and each prompt
    token's rank there."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    own = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return own, logp[:-1].topk(K, dim=-1).indices, ((logp[:-1] > own[:, None]).sum(1) + 1).tolist()


def _make(arch: str, root) -> tuple[str, list[list[int]], list]:
    from transformers import AutoModelForCausalLM

    path = str(make_checkpoint(arch, root / arch, seed=3, **DIMS))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with Engine(path, **OPTS) as e:
        ids = [e.encode(p) for p in PROMPTS]
        plain = [o.token_ids for o in e.generate(PROMPTS, PLAIN)]
    return path, plain, [_hf_scores(hf, i) for i in ids]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _make("qwen3_moe", tmp_path_factory.mktemp("plp"))


def _check(outs, plain, want) -> None:
    """Scored outputs: their tokens are the plain ones and their prompt scores transformers'."""
    assert [o.token_ids for o in outs] == plain
    for o, (lp, top, ranks) in zip(outs, want, strict=True):
        scores = o.prompt_logprobs
        assert scores is not None and scores[0] is None and len(scores) == len(o.prompt_token_ids)
        got = torch.tensor([s.logprob for s in scores[1:]])
        assert torch.allclose(got, lp, atol=2e-4), float((got - lp).abs().max())
        assert [s.top_token_ids for s in scores[1:]] == top.tolist()
        assert [s.rank for s in scores[1:]] == ranks


def test_chunks_mixed_steps_and_cache_hits_give_transformers_scores(qwen):
    path, plain, want = qwen
    with Engine(path, **OPTS, chunked_prefill_size=8, enable_mixed_chunk=True) as e:
        for _ in range(2):  # the second round: plain requests hit the radix cache, scored ones compute in full
            outs = e.generate(PROMPTS * 2, [PLAIN] * len(PROMPTS) + [SCORED] * len(PROMPTS))
            _check(outs[len(PROMPTS):], plain, want)
            assert [o.token_ids for o in outs[:len(PROMPTS)]] == plain
            assert all(o.prompt_logprobs is None for o in outs[:len(PROMPTS)])
        assert sum(o.cached_tokens for o in outs[:len(PROMPTS)]) > 0
        assert all(o.cached_tokens == 0 for o in outs[len(PROMPTS):])
        zero = e.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
        report = e.driver.idle_report()
    assert all(s.top_token_ids == [] for s in zero.prompt_logprobs[1:])
    assert [s.logprob for s in zero.prompt_logprobs[1:]] == pytest.approx(want[0][0].tolist(), abs=2e-4)
    assert report.clean


def test_retraction_keeps_one_score_per_prompt_token(qwen):
    path, plain, want = qwen
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    with Engine(path, **OPTS, max_total_tokens=120, chunked_prefill_size=16) as e:
        outs = e.generate(PROMPTS, long)
        retractions = e.driver.schedulers[0].num_retractions
        report = e.driver.idle_report()
    assert retractions > 0
    assert [o.token_ids[:N] for o in outs] == plain
    _check([dataclasses.replace(o, token_ids=o.token_ids[:N]) for o in outs], plain, want)
    assert report.clean


def test_nextn_drafting_steps_score_as_plain_steps_do(tmp_path):
    """With the MTP layer drafting (Qwen3.5-MoE's, a hybrid model), the step's logits come from the drafting path:
    the scores and tokens equal those without speculation."""
    dims = {**{k: v for k, v in DIMS.items() if k != "intermediate_size"}, "num_layers": 4}  # one full-attention
    path = str(make_checkpoint("qwen3_5_moe", tmp_path / "q35", seed=3, mtp_layers=1, **dims))
    spec = {"speculative_algorithm": "nextn", "speculative_num_steps": 2, "speculative_draft_policy": "fixed"}
    runs = []
    for extra in ({}, spec):
        with Engine(path, **OPTS, chunked_prefill_size=16, **extra) as e:
            outs = e.generate(PROMPTS, SCORED)
            assert e.driver.idle_report().clean
        runs.append(outs)
    for plain, drafted in zip(*runs, strict=True):
        assert drafted.token_ids == plain.token_ids and len(drafted.prompt_logprobs) == len(plain.prompt_token_ids)
        assert [s.top_token_ids for s in drafted.prompt_logprobs[1:]] == [
            s.top_token_ids for s in plain.prompt_logprobs[1:]]
        assert [s.logprob for s in drafted.prompt_logprobs[1:]] == pytest.approx(
            [s.logprob for s in plain.prompt_logprobs[1:]], rel=1e-4, abs=2e-4)  # (other batch shapes)


def test_dp2_ep2_with_tbo(ray_cluster, qwen):
    path, plain, want = qwen
    with Engine(path, **OPTS, dp_size=2, ep_size=2, enable_tbo=True, tbo_min_tokens_extend=4,
                chunked_prefill_size=16) as e:
        outs = e.generate(PROMPTS * 2, [PLAIN] * len(PROMPTS) + [SCORED] * len(PROMPTS))
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs[:len(PROMPTS)]] == plain
    _check(outs[len(PROMPTS):], plain, want)
    assert report.clean


def test_pd_prefill_instance_scores_and_the_answer_crosses_the_channel(ray_cluster, qwen):
    path, plain, want = qwen
    with Engine(path, **OPTS, pd_prefill="dp=1", pd_decode="dp=1") as e:
        outs = e.generate(PROMPTS, SCORED)
    _check(outs, plain, want)


def test_bad_values_name_their_field(qwen):
    for bad in (-1, 1.5, "2", 10**6):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(prompt_logprobs=bad)
        assert err.value.field == "prompt_logprobs"
    path, _, _ = qwen
    with Engine(path, **OPTS) as e:
        with pytest.raises(InvalidRequestError) as err:
            e.generate(PROMPTS[:1], SamplingParams(prompt_logprobs=DIMS["vocab_size"] + 1))
        assert err.value.field == "prompt_logprobs"


def test_rows_and_requests_file_scores_by_position():
    row = PromptScoreRow(0, 2, 3, 7, 1)
    assert row.targets([1, 2, 3]) == [2, 3, 7] and PromptScoreRow(0, 2, 2, -1, 1).targets([1, 2, 3]) == [2, 3]
    with pytest.raises(ValueError):
        PromptScoreRow(0, 2, 3, -1, 1).targets([1, 2, 3])  # the last position samples: nothing to score
    req = Req("r", [5, 6, 7, 8], SCORED)
    assert req.prompt_scored_to == 0
    req.add_prompt_logprobs(1, ["a", "b"])
    req.add_prompt_logprobs(1, ["a", "b", "c"])  # computed again after a retraction: only the new one is kept
    assert req.prompt_logprobs == [None, "a", "b", "c"] and req.prompt_scored_to is None
    with pytest.raises(ValueError):
        Req("q", [1, 2, 3], SCORED).add_prompt_logprobs(2, ["x"])  # a gap
    assert Req("s", [1, 2, 3], SCORED, output_ids=[4]).prompt_scored_to is None  # resumed: scored elsewhere


def test_the_lm_head_computes_only_the_rows_a_step_needs(qwen, monkeypatch):
    """A step scoring one short prompt beside a long plain prefill computes the LM head over the scored positions and
    the rows' sampling positions, not the plain prompt's tokens (``P x V`` logits, not ``T x V``)."""
    path, plain, want = qwen
    with Engine(path, **OPTS) as e:
        model = e.driver.executor.worker.runner.model
        seen = []
        head = model.compute_logits
        monkeypatch.setattr(model, "compute_logits", lambda h, n=None: (seen.append(h.shape[0]), head(h, n))[1])
        long_plain, short = PROMPTS[0] * 2, PROMPTS[3]
        outs = e.generate([long_plain, short], [PLAIN, SCORED])
    n_long, n_short = len(outs[0].prompt_token_ids), len(outs[1].prompt_token_ids)
    assert seen[0] == 1 + n_short < n_long  # the plain row's last position + the short prompt's every position
    assert outs[1].prompt_logprobs[1].logprob == pytest.approx(float(want[3][0][0]), abs=2e-4)


def test_a_scored_prompt_is_computed_in_bounded_chunks(qwen, monkeypatch):
    """With chunked prefill on, a request scoring its prompt computes at most ``MAX_PROMPT_SCORE_TOKENS`` tokens a
    step (its logits are that many vocabulary rows); its scores stay transformers'."""
    from raymoe.scheduler import prefill_adder

    path, plain, want = qwen
    monkeypatch.setattr(prefill_adder, "MAX_PROMPT_SCORE_TOKENS", 16)
    with Engine(path, **OPTS, chunked_prefill_size=64) as e:
        model = e.driver.executor.worker.runner.model
        seen = []
        head = model.compute_logits
        monkeypatch.setattr(model, "compute_logits", lambda h, n=None: (seen.append(h.shape[0]), head(h, n))[1])
        outs = e.generate(PROMPTS[:1], SCORED)
    _check(outs, plain[:1], want[:1])
    n = len(outs[0].prompt_token_ids)
    chunks = [rows for rows in seen if rows > 1]  # (eager decode steps compute one row; CUDA replays a graph)
    assert max(seen) <= 16 and len(chunks) >= n // 16, seen  # 63 prompt tokens: 4 chunks of at most 16
