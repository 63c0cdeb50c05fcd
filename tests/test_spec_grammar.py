"""Speculative decoding of grammar-constrained requests: the rank masks the target's logits at every draft position
with the grammar's mask there (``RankGrammars.mask_drafts``), so greedy tokens equal those of plain constrained
decoding; drafts are verified and accepted for constrained rows (they no longer turn a step into plain DECODE);
on one rank and at dp=2 ep=2 with two-batch overlap and decode graphs."""

from __future__ import annotations

import json

import pytest

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint
from raymoe.scheduler.spec_steps import SpecCounters
from raymoe.step.grammar import GrammarSpec

DIMS = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}
LOOP = "for i in range(10):\n    print(i)\n"
RECORD = '{"items": ["alpha", "beta", "alpha", "beta", "alpha", "beta"]}'  # xgrammar's compact JSON
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["alpha", "beta"]},
                                                     "minItems": 6, "maxItems": 6}},
          "required": ["items"], "additionalProperties": False}
# prompts that hold what the grammar makes the model write, so n-gram drafts exist while it writes it
WORK = [(LOOP * 3, GrammarSpec("regex", r"(for i in range\(10\):\n    print\(i\)\n){2,3}", field="regex")),
        (RECORD + "\n" + RECORD + "\n", GrammarSpec("json_schema", json.dumps(SCHEMA))),
        ("x = 1\n" * 6, GrammarSpec("regex", r"(x = [0-9]\n){4}", field="regex")),
        (LOOP * 2, None)]
OPTS = {"max_running_requests": 4, "chunked_prefill_size": 16, "max_context_len": 200, "cuda_graph_max_bs": 4}
SPEC = {"speculative_algorithm": "ngram", "speculative_num_steps": 3, "speculative_draft_policy": "fixed"}


def params(spec: GrammarSpec | None) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=0.0, grammar=spec)


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    path = str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("specg") / "qwen3_moe", seed=3, **DIMS))
    with Engine(path, **OPTS) as e:
        ref = [e.generate([p], params(s))[0] for p, s in WORK]
    return path, ref


def run(engine: Engine) -> tuple[list, SpecCounters]:
    outs = [engine.generate([p for p, _ in WORK], [params(s) for _, s in WORK])][0]
    return outs, SpecCounters.total(s.spec for s in engine.driver.group_stats())


def check(outs, ref, counters: SpecCounters) -> None:
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert [o.finish_reason for o in outs] == [r.finish_reason for r in ref]
    assert counters.verify_steps > 0 and counters.accepted_tokens > 0, counters
    # the constrained answers follow their grammars (the grammar, not the model, decides)
    doc = json.loads(outs[1].text)
    assert len(doc["items"]) == 6 and set(doc["items"]) <= {"alpha", "beta"}
    assert outs[0].text.startswith(LOOP * 2)


def test_constrained_rows_verify_drafts_on_one_rank(model_and_reference):
    path, ref = model_and_reference
    with Engine(path, **OPTS, **SPEC) as e:
        outs, counters = run(e)
        report = e.driver.idle_report()
    check(outs, ref, counters)
    assert sum(o.accepted_prediction_tokens for o in outs[:3]) > 0  # the constrained requests' drafts
    assert report.clean


def test_constrained_rows_verify_drafts_at_dp2_ep2_with_tbo_and_graphs(ray_cluster, model_and_reference):
    path, ref = model_and_reference
    with Engine(path, dp_size=2, ep_size=2, **OPTS, **SPEC, enable_tbo=True, tbo_min_tokens_decode=2,
                tbo_min_tokens_extend=4) as e:
        outs, counters = run(e)
        graph_steps, report = e.driver.num_graph_steps, e.driver.idle_report()
    check(outs, ref, counters)
    assert graph_steps > 0 and report.clean
