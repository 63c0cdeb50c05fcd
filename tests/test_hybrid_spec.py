"""Speculative decoding on hybrid models (Qwen3.5-MoE): a verify step advances each linear-attention layer over the
drafts, keeps the conv and recurrent states after each (``VerifyStates``) and commits the one the accepted drafts
reach. Checked: one verify step against plain decoding with 0, 1 and 2 of 2 drafts accepted (the next step's logits);
in the engine, ``ngram`` drafts verified every step (``fixed`` policy) give the greedy tokens of speculation off
(and transformers') on one rank (MIXED steps, chunked prefill) and at dp=2 ep=2 with two-batch overlap, nothing
leaks; a stash a failed step left is not committed by the next. (The random-weight model does not repeat itself,
so the engine's drafts are all rejected: every verify step rolls back; partial acceptance is the unit test's.)"""

from __future__ import annotations

import pytest
import torch
from hf_models import greedy_reference
from test_spec_engine import GREEDY, OPTS, PROMPTS, SPEC, TBO, spec_counters

from raymoe import Engine
from raymoe.config_linear import LinearAttentionConfig
from raymoe.kvcache.state_pool import RecurrentStatePool, VerifyStates
from raymoe.models.checkpoint import make_checkpoint

DIMS = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "vocab_size": 512}


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    path = str(make_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("hspec") / "q35", seed=3, **DIMS))
    with Engine(path, **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    return path, ref


def test_one_rank_gives_the_tokens_of_plain_decoding_and_transformers(model_and_reference):
    path, ref = model_and_reference
    assert ref[:2] == greedy_reference(path, PROMPTS[:2], GREEDY.max_tokens)
    with Engine(path, **OPTS, **SPEC, speculative_draft_policy="fixed") as e:
        outs = e.generate(PROMPTS, GREEDY)
        counters = spec_counters(e)
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and counters.draft_tokens > counters.verify_steps, counters
    assert (report.leaked_kv_slots, report.leaked_req_rows) == (0, 0)


def test_dp2_ep2_with_tbo(ray_cluster, model_and_reference):
    path, ref = model_and_reference
    with Engine(path, dp_size=2, ep_size=2, **OPTS, **TBO, **SPEC, speculative_draft_policy="fixed") as e:
        outs = e.generate(PROMPTS, GREEDY)
        counters, tbo_steps = spec_counters(e), e.driver.num_tbo_steps
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and tbo_steps > 0


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_a_verify_step_leaves_the_states_of_its_accepted_drafts(model_and_reference, accepted):
    """One TARGET_VERIFY step over a newest token and two drafts, ``accepted`` of them committed, then a decode
    step: its logits equal those of plain decoding of the same accepted tokens (the conv and recurrent states were
    rolled back to the last accepted token; the verify logits equal plain decoding's too)."""
    from test_deepseek_parity import _extend_batch

    from raymoe.config import GraphConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig
    from raymoe.step.forward_mode import ForwardMode
    from raymoe.step.sampling_inputs import SamplingInputs
    from raymoe.step.worker_batch import ModelWorkerBatch

    path, _ = model_and_reference
    plain, spec = (ModelRunner(RunnerConfig(path, "float32", num_kv_slots=256, max_req_rows=2, max_context_len=64,
                                            graph=GraphConfig(disable_cuda_graph=True))) for _ in range(2))
    prompt, tokens, bonus = list(range(5, 25)), [30, 31, 32], 40
    n = len(prompt)
    for r in (plain, spec):
        r.forward(r.prepare(_extend_batch([prompt])))

    def decode(runner, token, pos):
        wb = ModelWorkerBatch(ForwardMode.DECODE, [token], [0], [pos + 1], [pos], [1], [100 + pos - n],
                              sampling=SamplingInputs.greedy(1))
        return runner.forward(runner.prepare(wb))[0]

    plain_logits = [decode(plain, t, n + i) for i, t in enumerate(tokens[:1 + accepted] + [bonus])]
    wb = ModelWorkerBatch(ForwardMode.TARGET_VERIFY, tokens, [0], [n + 3], [n], [3], [100, 101, 102],
                          sampling=SamplingInputs.greedy(1), table_lens=[n])
    fb = spec.prepare(wb)
    verify_logits = spec.forward(fb, return_all_logits=True)
    for i in range(1 + accepted):
        torch.testing.assert_close(verify_logits[i], plain_logits[i], rtol=1e-4, atol=1e-4)
    spec.model.commit_verify_states(fb.req_pool_indices, torch.tensor([accepted]))
    torch.testing.assert_close(decode(spec, bonus, n + 1 + accepted), plain_logits[-1], rtol=1e-4, atol=1e-4)


def test_commit_writes_the_accepted_candidate_and_clear_forgets():
    lin = LinearAttentionConfig(1, 2, 4, 4, 3)
    pool = RecurrentStatePool(lin, 1, 4, "cpu")
    states = VerifyStates(pool)
    conv = torch.arange(2 * 3 * lin.conv_dim * 2, dtype=torch.float32).view(2, 3, lin.conv_dim, 2)
    ssm = torch.arange(2 * 3 * 2 * 4 * 4, dtype=torch.float32).view(2, 3, 2, 4, 4)
    states.stash(0, torch.tensor([3, 1]), conv, ssm)
    states.commit(torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1]))  # row 1 accepted 2 drafts, row 3 one
    assert torch.equal(pool.conv[0, 3], conv[0, 1]) and torch.equal(pool.ssm[0, 1], ssm[1, 2])
    assert not pool.conv[0, 2].any()  # a row without a stash is untouched
    states.stash(0, torch.tensor([2]), conv[:1], ssm[:1])
    states.clear()
    states.commit(torch.tensor([2]), torch.tensor([1]))
    assert not pool.conv[0, 2].any()
