"""Presence, frequency and repetition penalties and ``logit_bias`` (``raymoe.runner.penalties``): greedy tokens equal
transformers' with the same processing (its ``RepetitionPenaltyLogitsProcessor``, OpenAI's penalty formula, the
bias), whatever the engine does around them: chunked prefill and MIXED steps (a chunk that does not reach its
prompt's end counts nothing), radix-cache hits (the repetition penalty still sees the cached prompt), retraction
(the output so far is counted again), overlap scheduling, n-gram speculation beside them, dp=2 ep=2 with two-batch
overlap and decode graphs; requests without them in the same steps keep their plain tokens, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from raymoe import Engine, SamplingParams
from raymoe.errors import InvalidRequestError
from raymoe.models.checkpoint import make_checkpoint
from raymoe.platform.cpu.platform import CpuPlatform
from raymoe.platform.selector import reference_platform
from raymoe.runner.penalties import RankPenalties
from raymoe.step.logit_penalties import LogitPenalties
from raymoe.step.sampling_inputs import SamplingRow

DIMS = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}
PROMPTS = ["a b a b a b a b a b a b", "hello hello hello", "for i in range(10):\n    print(i)\n" * 2, "x"]
N = 20
PENALIZED = [  # (presence, frequency, repetition, logit bias)
    (0.0, 0.0, 1.6, {273: 17.5}),  # 273: a prompt token, first pick with the bias unless the penalty sees it
    (0.0, 0.3, 1.0, {11: 4.5}),  # + the plain first token at -100 (model_and_reference); the output repeats a token
    (-0.5, 0.7, 1.3, {5: 3.0, 300: -100.0}),
    (1.0, 2.0, 1.0, {}),
]
OPTS = {"max_running_requests": 4, "max_context_len": 160, "cuda_graph_max_bs": 4, "dtype": "float32"}  # (fp32 oracle)
TIGHT_KV = 70  # KV slots: the four requests outgrow them and some are retracted after generating tokens


def _params(case) -> SamplingParams:
    presence, frequency, repetition, bias = case
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, presence_penalty=presence,
                          frequency_penalty=frequency, repetition_penalty=repetition, logit_bias=bias)


def _hf_greedy(hf, ids: list[int], case) -> list[int]:
    """transformers' greedy tokens with the penalties applied in vLLM's order: bias, repetition, presence and
    frequency (OpenAI's formula over the output tokens)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    presence, frequency, repetition, bias = case
    seq = list(ids)
    with torch.no_grad():
        for _ in range(N):
            x = torch.tensor([seq])
            scores = hf(x).logits[:, -1].float()
            for t, v in bias.items():
                scores[0, t] += v
            if repetition != 1.0:
                scores = RepetitionPenaltyLogitsProcessor(repetition)(x, scores)
            counts = torch.bincount(torch.tensor(seq[len(ids):], dtype=torch.int64), minlength=scores.shape[1])
            scores = scores - frequency * counts - presence * (counts > 0).float()
            seq.append(int(scores.argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("pen") / "m", seed=3, **DIMS))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with Engine(path, **OPTS) as e:
        ids = [e.encode(p) for p in PROMPTS]
        plain = [o.token_ids for o in e.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0,
                                                                         ignore_eos=True))]
    # case 1 forbids its prompt's plain first token, whichever the tokenizer made it (the demo tokenizer is trained
    # on the local Python's standard library, so ids differ between machines): it changes the tokens everywhere
    PENALIZED[1][3][plain[1][0]] = -100.0
    want = [_hf_greedy(hf, i, c) for i, c in zip(ids, PENALIZED, strict=True)]
    assert all(w != p for w, p in zip(want, plain, strict=True))  # every case changes the tokens
    return path, plain, want


def _run(engine: Engine, rounds: int = 1) -> tuple[list, int]:
    """Each round: the penalized requests and, beside them, the same prompts plain; ``[penalized, plain]`` tokens
    per round, and the prompt tokens the penalized requests found in the radix cache."""
    out, cached = [], 0
    for _ in range(rounds):
        outs = engine.generate(PROMPTS + PROMPTS, [_params(c) for c in PENALIZED] +
                               [SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)] * len(PROMPTS))
        out.append([[o.token_ids for o in outs[:len(PROMPTS)]], [o.token_ids for o in outs[len(PROMPTS):]]])
        cached += sum(o.cached_tokens for o in outs[:len(PROMPTS)])
    return out, cached


def test_chunked_prefill_mixed_steps_and_cache_hits_give_transformers_tokens(model_and_reference):
    path, plain, want = model_and_reference
    with Engine(path, **{**OPTS, "max_running_requests": 8}, chunked_prefill_size=8, enable_mixed_chunk=True) as e:
        rounds, cached = _run(e, rounds=2)  # the second round hits the radix cache
        report = e.driver.idle_report()
    for penalized, unpenalized in rounds:
        assert penalized == want
        assert unpenalized == plain
    assert cached > 0 and report.clean


def test_retraction_counts_the_output_again(model_and_reference, monkeypatch):
    path, _, want = model_and_reference
    admitted = []  # output tokens each admission's counts start from
    admit = RankPenalties._admit
    monkeypatch.setattr(RankPenalties, "_admit", lambda self, r, row: (
        admitted.append(len(row.penalties.output_ids) if row.penalties else None), admit(self, r, row))[1])
    with Engine(path, **OPTS, max_total_tokens=TIGHT_KV, chunked_prefill_size=64) as e:
        outs = e.generate(PROMPTS, [_params(c) for c in PENALIZED])
        retractions = e.driver.schedulers[0].num_retractions
        report = e.driver.idle_report()
    assert retractions > 0 and any(admitted)  # a request came back with its output so far
    assert [o.token_ids for o in outs] == want
    assert report.clean


def test_ngram_speculation_beside_penalized_requests(model_and_reference):
    path, plain, want = model_and_reference
    with Engine(path, **OPTS, speculative_algorithm="ngram", speculative_num_steps=3) as e:
        [(penalized, _)] = _run(e)[0]
        alone = e.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
        report = e.driver.idle_report()
    assert penalized == want and [o.token_ids for o in alone] == plain
    assert report.clean


def test_dp2_ep2_with_tbo_and_graphs(ray_cluster, model_and_reference):
    path, plain, want = model_and_reference
    with Engine(path, **{**OPTS, "max_running_requests": 8}, dp_size=2, ep_size=2, enable_tbo=True,
                tbo_min_tokens_decode=2) as e:
        [(penalized, unpenalized)] = _run(e)[0]
        graph_steps = e.driver.num_graph_steps
        report = e.driver.idle_report()
    assert penalized == want and unpenalized == plain
    assert graph_steps > 0 and report.clean


@pytest.mark.parametrize("platform", [reference_platform(), CpuPlatform()], ids=["reference", "cpu_kernel"])
def test_rank_penalties_match_the_formulas_and_count_only_kept_tokens(platform):
    """The rank's arithmetic on random logits against the formulas written out; a partial prefill chunk's token is
    not counted, a row admitted again without penalties is left alone."""
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    v = 16
    pen = RankPenalties(rows=4, vocab=v, device=torch.device("cpu"), ops=platform)
    p = LogitPenalties(presence=0.5, frequency=0.25, repetition=1.5, bias=((3, 2.0), (7, -1.0)), prompt_ids=(1, 2),
                       output_ids=(4, 4, 9))
    pen.admit([(0, SamplingRow(1.0, 1.0, -1, 0.0, None, None, 10, p)),
               (1, SamplingRow(1.0, 1.0, -1, 0.0, None, None, 5))], pool=[2, 3])
    assert pen.rows_of([3, 2]) == [1]
    logits = torch.randn(2, v, generator=g)
    got = pen.apply(logits, [2, 3], [0], [0], [9, 9])
    want = logits[0].clone()
    want[3] += 2.0
    want[7] -= 1.0
    want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[1, 2, 4, 4, 9]]), want[None])[0]
    counts = torch.bincount(torch.tensor([4, 4, 9]), minlength=v).float()
    want = want - 0.25 * counts - 0.5 * (counts > 0).float()
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], logits[1])  # the other row is untouched, and so is the input
    # seq_len 12 < 10 + 3: a chunk short of the row's end samples a dropped token; 13 reaches it
    pen.record(torch.tensor([9, 0]), [2, 3], [0], [12, 1])
    torch.testing.assert_close(pen.apply(logits, [2, 3], [0], [0], [9, 9])[0], got[0])
    pen.record(torch.tensor([9, 0]), [2, 3], [0], [13, 1])
    assert not torch.equal(pen.apply(logits, [2, 3], [0], [0], [9, 9])[0], got[0])
    pen.admit([(0, SamplingRow(1.0, 1.0, -1, 0.0, None, None, 10))], pool=[2])
    assert pen.rows_of([2, 3]) == []


@pytest.mark.parametrize(("field", "kwargs"), [
    ("presence_penalty", {"presence_penalty": 2.5}), ("frequency_penalty", {"frequency_penalty": float("nan")}),
    ("repetition_penalty", {"repetition_penalty": 0.0}), ("logit_bias", {"logit_bias": {1: 101.0}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}), ("logit_bias", {"logit_bias": {"a": 1.0}}),
])
def test_out_of_range_values_name_their_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_a_bias_outside_the_vocabulary_fails_that_request_alone(model_and_reference):
    path, plain, _ = model_and_reference
    with Engine(path, **OPTS) as e:
        with pytest.raises(InvalidRequestError) as err:
            e.generate(["x"], SamplingParams(max_tokens=2, logit_bias={DIMS["vocab_size"]: 1.0}))
        again = e.generate(PROMPTS[:1], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    assert err.value.field == "logit_bias" and again[0].token_ids == plain[0]


def test_pd_decode_instance_counts_the_prefill_token(ray_cluster, model_and_reference):
    """Prefill/decode disaggregation: the decode instance's counts start from the prompt and the prefill's token."""
    path, _, want = model_and_reference
    with Engine(path, **OPTS, pd_prefill="dp=1", pd_decode="dp=1") as e:
        outs = e.generate(PROMPTS, [_params(c) for c in PENALIZED])
    assert [o.token_ids for o in outs] == want


def test_a_grammar_mask_holds_against_bias_and_penalties(model_and_reference):
    """A token the grammar refuses stays refused however strongly it is biased, and a penalized constrained answer
    still matches its expression."""
    import re

    from raymoe.step.grammar import GrammarSpec

    path, _, _ = model_and_reference
    pattern = "[a-z]{4,12}@(foo|bar)\\.(com|org)"
    with Engine(path, **OPTS) as e:
        tok = e.tokenizer
        banned = [t for t in range(DIMS["vocab_size"]) if tok.decode([t]).strip() and
                  not re.fullmatch("[a-z@.]+", tok.decode([t]).strip())][:50]
        params = SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.5,
                                logit_bias={t: 100.0 for t in banned},
                                grammar=GrammarSpec("regex", pattern, field="regex"))
        out = e.generate(["email: "], params)[0]
    assert re.fullmatch(pattern, out.text), out.text


def test_seeded_sampling_with_penalties_repeats_whatever_shares_the_batch(model_and_reference):
    path, _, _ = model_and_reference
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=9, presence_penalty=0.5, frequency_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={5: 2.0})
    with Engine(path, **OPTS) as e:
        alone = e.generate(PROMPTS[:1], params)[0].token_ids
        shared = e.generate(PROMPTS, [params] + [SamplingParams(max_tokens=N, temperature=0.7)] * 3)[0].token_ids
    assert alone == shared


def test_the_cpu_kernel_computes_what_the_reference_does():
    """``Platform.apply_penalties``: the CPU platform's C pass against the reference's operators, on rows wider
    than the vocabulary (a padded LM head), with refused (-inf) logits, counted and marked tokens, with and without
    prompt marks."""
    g = torch.Generator().manual_seed(1)
    table, vocab, n = 6, 300, 4
    counts = torch.randint(0, 3, (table, vocab), generator=g).float() * (torch.rand(table, vocab, generator=g) < 0.1)
    seen = torch.rand(table, vocab, generator=g) < 0.05
    rows = torch.tensor([5, 0, 3, 3])
    numbers = [torch.tensor(v, dtype=torch.float32) for v in
               ([0.5, -1.0, 0.0, 2.0], [0.25, 0.0, -2.0, 1.5], [1.3, 1.0, 0.7, 1e4])]
    for marks in (seen, None):
        x = torch.randn(n, vocab + 12, generator=g) * 5
        x[0, :40] = float("-inf")
        want, got = x.clone(), x.clone()
        reference_platform().apply_penalties(want[:, :vocab], counts, marks, rows, *numbers)
        CpuPlatform().apply_penalties(got[:, :vocab], counts, marks, rows, *numbers)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(got[:, :vocab], x[:, :vocab]) and torch.equal(got[:, vocab:], x[:, vocab:])
    with pytest.raises(ValueError, match="outside the count table"):
        CpuPlatform().apply_penalties(x[:1, :vocab].contiguous(), counts, None, torch.tensor([table]),
                                      numbers[0][:1], numbers[1][:1], numbers[2][:1])


def test_min_tokens_masks_stop_ids_until_then_and_the_driver_ignores_stops(model_and_reference):
    """``min_tokens``: with every EOS id pushed to the top by a bias, a plain request ends at its first token; with
    ``min_tokens`` 5 its first five tokens are transformers' greedy ones with the EOS ids masked, then EOS ends it.
    A stop token id and a stop string inside the first ``min_tokens`` tokens end nothing either."""
    path, plain, _ = model_and_reference
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with Engine(path, **OPTS, chunked_prefill_size=8) as e:
        eos = sorted(e.model_config.eos_token_ids)
        bias = {t: 100.0 for t in eos}
        early = e.generate(PROMPTS[:2], SamplingParams(max_tokens=N, temperature=0.0, logit_bias=bias))
        held = e.generate(PROMPTS[:2], SamplingParams(max_tokens=N, temperature=0.0, logit_bias=bias, min_tokens=5))
        stop_id = plain[0][1]  # the plain greedy second token, as a stop token id: masked before min_tokens 3
        ids = e.generate(PROMPTS[:1], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[stop_id], min_tokens=3))[0]
        text = e.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].text
        strings = e.generate(PROMPTS[:1], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                         stop=[text[-2:]], min_tokens=N))[0]
        unheld = e.generate(PROMPTS[:1], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True,
                                                        stop=[text[-2:]]))[0]
        report = e.driver.idle_report()
    assert all(len(o.token_ids) == 1 and o.token_ids[0] in eos and o.finish_reason == "stop" for o in early)
    for o in held:
        seq, want = list(o.prompt_token_ids), []
        with torch.no_grad():
            for _ in range(5):
                scores = hf(torch.tensor([seq + want])).logits[0, -1].float()
                scores[eos] = float("-inf")
                want.append(int(scores.argmax()))
        assert o.token_ids[:5] == want and o.token_ids[5] in eos and len(o.token_ids) == 6, (o.token_ids, want)
        assert o.finish_reason == "stop"
    assert ids.token_ids[0] == plain[0][0] and ids.token_ids[1] != stop_id and stop_id not in ids.token_ids[:3]
    assert ids.finish_reason == "length" or (ids.token_ids[-1] == stop_id and ids.finish_reason == "stop")
    assert len(strings.token_ids) == N and strings.finish_reason == "length"
    assert len(unheld.token_ids) <= 4 and unheld.finish_reason == "stop"  # the same stop string, without min_tokens
    assert report.clean
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=3, min_tokens=4)
    assert err.value.field == "min_tokens"


def test_rank_masks_stop_ids_while_the_step_samples_one_of_the_first_min_tokens():
    pen = RankPenalties(rows=2, vocab=8, device=torch.device("cpu"), ops=reference_platform())
    pen.admit([(0, SamplingRow(1.0, 1.0, -1, 0.0, None, None, 10, LogitPenalties(min_tokens=3, stop_ids=(2, 5))))],
              pool=[1])
    logits = torch.zeros(1, 8)
    for seq_len, masked in ((10, True), (12, True), (13, False)):  # output token 0, 2 (masked) and 3 (free)
        got = pen.apply(logits, [1], [0], [0], [seq_len])
        assert torch.isinf(got[0, [2, 5]]).all() == masked and torch.isfinite(got[0, [0, 1, 3, 4, 6, 7]]).all()
