"""Grammar-constrained decoding in the engine (``raymoe.runner.grammar``): exact against an independent oracle,
kept through retraction, chunked prefill, overlap scheduling and every topology, and never a failed step.

The oracle is Hugging Face ``generate`` (greedy, fp32) with xgrammar's own transformers logits processor
(``xgrammar.contrib.hf.LogitsProcessor``), a different code path that masks the full logits of every step, followed
by a well-formed-UTF-8 filter written here token by token from ``utf8_mask.advance`` (the engine keeps constrained
output well-formed UTF-8 through precomputed state masks). Greedy tokens of a constrained request must equal it
token for token. The schemas bound every string and array, so every
document the grammar allows ends within the token budget: the tiny model writes noise, and the grammar alone makes
it valid.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from pydantic import BaseModel, Field

from raymoe import Engine, SamplingParams
from raymoe.errors import InvalidRequestError
from raymoe.runner.utf8_mask import advance
from raymoe.step.grammar import GrammarSpec


class Item(BaseModel):
    name: str = Field(max_length=12)
    qty: int = Field(ge=0, le=999)
    unit: str = Field(pattern=r"^(kg|g|l)$")


class Order(BaseModel):
    customer: str = Field(max_length=16)
    priority: int = Field(ge=1, le=5)
    express: bool
    items: list[Item] = Field(max_length=2)


SCHEMA = GrammarSpec("json_schema", json.dumps(Order.model_json_schema()), strict=True)
REGEX = GrammarSpec("regex", r"[a-z]{2,8}@(foo|bar)\.(com|org)", field="regex")
PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Foo(object):", "x", "# Licensed under the Apache",
           "return self._cache[key]"]
MAX_TOKENS = 160
OPTS = {"max_context_len": 256}


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(tiny_model, hf_model):
    """Greedy tokens per (prompt, spec kind) from transformers + xgrammar's logits processor."""
    from transformers import AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    from raymoe.runner.grammar_compiler import compiler_for_model

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = hf_model.config
    eos = tuple(hf_model.generation_config.eos_token_id)
    compiler = compiler_for_model(tiny_model, cfg.vocab_size, eos)
    vocab, special = compiler.info.decoded_vocab, set(compiler.info.special_token_ids)

    def well_formed(prompt_len: int):
        def keep_utf8(input_ids, scores):
            state = advance(0, b"".join(vocab[t] for t in input_ids[0, prompt_len:].tolist() if t not in special))
            ok = torch.tensor([(t in special and state == 0) or (t not in special and advance(state, vocab[t])
                                                                  is not None) for t in range(scores.shape[1])])
            allowed = scores[0] > float("-inf")
            if bool((ok & allowed).any()):
                scores[0, ~ok] = float("-inf")
            return scores
        return keep_utf8

    out = {}
    for spec in (SCHEMA, REGEX):
        compiled = compiler.compile(spec)
        for p in PROMPTS:
            ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
            with torch.no_grad():
                gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                        do_sample=False,
                                        logits_processor=[LogitsProcessor(compiled), well_formed(ids.shape[1])])
            out[p, spec.kind] = gen[0, ids.shape[1]:].tolist()
    return out


def _params(spec: GrammarSpec, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=spec, **kw)


def _check(outs, specs, reference) -> None:
    for p, spec, out in zip(PROMPTS * 2, specs, outs, strict=True):
        assert out.token_ids == reference[p, spec.kind], (p, spec.kind, out.text)
        assert out.finish_reason == "stop"
        if spec is SCHEMA:
            Order.model_validate_json(out.text)
        else:
            assert re.fullmatch(REGEX.source, out.text), out.text


def _run(engine: Engine):
    specs = [SCHEMA] * len(PROMPTS) + [REGEX] * len(PROMPTS)
    outs = engine.generate(PROMPTS * 2, [_params(s) for s in specs])
    return outs, specs


def test_greedy_constrained_tokens_match_transformers_with_xgrammar(tiny_model, reference):
    """Beside unconstrained requests (which keep their own tokens), constrained rows give the oracle's tokens and
    end with ``stop`` when their grammar completes; the output parses."""
    with Engine(tiny_model, **OPTS) as e:
        free = e.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.0))
        outs, specs = _run(e)
        mixed = e.generate(PROMPTS[:2] + PROMPTS[:1], [SamplingParams(max_tokens=12, temperature=0.0),
                                                       SamplingParams(max_tokens=12, temperature=0.0),
                                                       _params(SCHEMA)])
    _check(outs, specs, reference)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in free]
    assert mixed[2].token_ids == reference[PROMPTS[0], "json_schema"]


def test_retraction_and_chunked_prefill_resume_the_grammar(tiny_model, reference):
    """A small KV pool retracts constrained requests mid-document; on re-admission the ranks rebuild each matcher
    from the tokens generated so far (``GrammarRow.output_ids``) and the tokens stay the oracle's."""
    with Engine(tiny_model, max_total_tokens=160, chunked_prefill_size=8, **OPTS) as e:
        outs, specs = _run(e)
        retractions = e.driver.schedulers[0].num_retractions
    assert retractions > 0
    _check(outs, specs, reference)


def test_sampled_constrained_outputs_are_valid(tiny_model):
    """Temperature 1 with seeds: every document validates (the grammar guarantees it, not the model), and a seed
    gives the same document in a different batch."""
    with Engine(tiny_model, **OPTS) as e:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, grammar=SCHEMA) for i in range(12)]
        outs = e.generate(["order:"] * 12, params)
        again = e.generate(["order:"], params[3])
    for o in outs:
        assert o.finish_reason == "stop"
        Order.model_validate_json(o.text)
    assert again[0].token_ids == outs[3].token_ids
    assert len({o.text for o in outs}) > 6


def test_a_grammar_the_ranks_cannot_build_ends_its_request_not_the_step(tiny_model):
    """``Engine.generate`` refuses a grammar that does not compile (naming the field); one that reaches the driver
    anyway (a caller of the driver's API) ends with ``abort`` on its first sampled token, and the requests beside it
    finish normally."""
    bad = GrammarSpec("ebnf", "root ::= undefined_rule", field="ebnf")
    with Engine(tiny_model, **OPTS) as e:
        with pytest.raises(InvalidRequestError) as err:
            e.generate("x", _params(bad))
        assert err.value.field == "ebnf"
        d = e.driver
        reqs = [d.add_request(d.new_rid(), e.encode(p), params)
                for p, params in (("x", _params(bad)), ("def fib(n):", SamplingParams(max_tokens=8, temperature=0.0)))]
        while d.has_unfinished():
            d.step()
        assert reqs[0].finished_reason.kind == "abort" and reqs[0].output_ids == []
        assert reqs[1].finished_reason.kind == "length" and len(reqs[1].output_ids) == 8


def test_a_schema_that_is_not_a_json_object_is_refused_naming_its_field(tiny_model):
    """``SamplingParams`` checks only a spec's shape (it runs again at every admission in the step loop); a
    schema that is not the JSON text of an object is refused when it is compiled, naming the spec's field."""
    from raymoe.runner.grammar_compiler import compiler_for_model

    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(grammar=GrammarSpec("regex", "", field="regex"))
    assert err.value.field == "regex"
    from pathlib import Path

    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    compiler = compiler_for_model(tiny_model, cfg["vocab_size"], (cfg["eos_token_id"],))
    for source in ("[1, 2]", "{not json", '"a string"'):
        with pytest.raises(InvalidRequestError) as err:
            compiler.compile(GrammarSpec("json_schema", source, field="response_format"))
        assert err.value.field == "response_format", source


@pytest.mark.parametrize(("tp", "dp", "ep", "tbo"), [(1, 2, 2, True), (2, 1, 1, False)])
def test_constrained_decoding_in_topologies(ray_cluster, tiny_model, reference, tp, dp, ep, tbo):
    """DP groups with EP and two-batch overlap (every rank of a group masks its own rows), and TP (every TP rank
    masks the same rows alike), with decode graphs and overlap scheduling: the oracle's tokens."""
    extra = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4} if tbo else {}
    with Engine(tiny_model, tp_size=tp, dp_size=dp, ep_size=ep, cuda_graph_max_bs=8, **OPTS, **extra) as e:
        outs, specs = _run(e)
        graph_steps = e.driver.num_graph_steps
    _check(outs, specs, reference)
    assert graph_steps > 0


def test_log_probs_of_constrained_rows_are_the_models_and_finite(tiny_model):
    """A constrained request asking for log-probs gets the model's own distribution (unmasked, as vLLM answers by
    default): every value finite, ``k`` alternatives even where the grammar allows one token, and the chosen token's
    log-prob the unconstrained engine's for the same prefix."""
    import math

    spec = GrammarSpec("regex", "Alive", field="regex")
    with Engine(tiny_model, **OPTS) as e:
        out = e.generate("x", SamplingParams(max_tokens=8, temperature=0.0, logprobs=10, grammar=spec))[0]
        free = e.generate(prompt_token_ids=[e.encode("x")], sampling_params=SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=10))[0]
    assert out.text == "Alive" and out.finish_reason == "stop"
    for lp in out.logprobs:
        assert math.isfinite(lp.logprob) and len(lp.top_logprobs) == 10
        assert all(math.isfinite(v) for v in lp.top_logprobs)
    assert out.logprobs[0].top_token_ids == free.logprobs[0].top_token_ids
    assert out.logprobs[0].top_logprobs == pytest.approx(free.logprobs[0].top_logprobs, abs=1e-5)
