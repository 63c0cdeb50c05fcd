"""Speculative decoding on hybrid models (Qwen3.5-MoE): a verify step advances each linear-attention layer over the
drafts, keeps the conv and recurrent states after each (``VerifyStates``) and commits the one the accepted drafts
reach. Checked: one verify step against plain decoding with 0, 1 and 2 of 2 drafts accepted (the next step's logits);
in the engine, ``ngram`` drafts verified every step (``fixed`` policy) give the greedy tokens of speculation off
(and transformers') on one rank (MIXED steps, chunked prefill) and at dp=2 ep=2 with two-batch overlap, nothing
leaks; a stash a failed step left is not committed by the next. The MTP layer (``nextn``): its pass against the same
computation written with transformers' modules, and in the engine for Qwen3.5 and Qwen3-Next. (The random-weight
model does not repeat itself and its MTP layer is untrained, so the engine's drafts are all rejected: every verify
step rolls back; partial acceptance is the unit test's.)"""

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


def test_the_mtp_layer_matches_transformers_parts(tmp_path):
    """``make-checkpoint --arch qwen3_5_moe`` with ``mtp_layers=1``: raymoe's MTP pass over a prompt (the target's
    hidden state at each position and the next token) gives the logits of the same computation written with
    transformers' own modules: its zero-centered norms, ``fc`` over [embedding; hidden], a
    ``Qwen3_5MoeDecoderLayer`` of the full-attention kind loaded with ``mtp.layers.0.*`` (causal mask and rotary
    embedding as transformers' model passes them), the final norm and the shared LM head."""
    from safetensors.torch import load_file
    from test_deepseek_parity import _extend_batch
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

    from raymoe.config import GraphConfig
    from raymoe.config.speculative import SpeculativeConfig
    from raymoe.runner.model_runner import ModelRunner, RunnerConfig

    path = str(make_checkpoint("qwen3_5_moe", tmp_path / "mtp", seed=5, mtp_layers=1, **DIMS))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    full = hf.config.layer_types.index("full_attention")
    seen = {}
    hf.model.layers[full].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    prompt = torch.randint(3, 500, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    nxt = prompt[1:] + [7]  # the token after each position (the last one: a sampled token)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        w = {k[len("mtp."):]: v for k, v in load_file(f"{path}/model.safetensors").items() if k.startswith("mtp.")}
        layer = Qwen3_5MoeDecoderLayer(hf.config, full).eval()
        lw = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.") and ".experts." not in k}
        e = hf.config.num_experts
        ex = "layers.0.mlp.experts"
        lw["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[f"{ex}.{i}.gate_proj.weight"], w[f"{ex}.{i}.up_proj.weight"]]) for i in range(e)])
        lw["mlp.experts.down_proj"] = torch.stack([w[f"{ex}.{i}.down_proj.weight"] for i in range(e)])
        layer.load_state_dict(lw)
        norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            norms[name] = Qwen3_5MoeRMSNorm(hf.config.hidden_size, eps=hf.config.rms_norm_eps)
            norms[name].weight.copy_(w[f"{name}.weight"])
        x = torch.cat([norms["pre_fc_norm_embedding"](hf.model.embed_tokens(torch.tensor(nxt))),
                       norms["pre_fc_norm_hidden"](hidden)], dim=-1) @ w["fc.weight"].T
        out = layer(x[None], position_embeddings=seen["position_embeddings"], attention_mask=seen["attention_mask"],
                    position_ids=seen.get("position_ids"))
        ref = hf.lm_head(norms["norm"](out[0] if out.dim() == 3 else out))

    runner = ModelRunner(RunnerConfig(path, "float32", num_kv_slots=64, max_req_rows=2, max_context_len=64,
                                      graph=GraphConfig(disable_cuda_graph=True),
                                      speculative=SpeculativeConfig(speculative_algorithm="nextn")))
    with torch.no_grad():
        fb = runner.prepare(_extend_batch([prompt]))
        mine = runner.model.mtp.logits(runner.model.mtp(fb, torch.tensor(nxt), runner.model(fb)))
    torch.testing.assert_close(mine, ref.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_nextn_drafts_with_the_checkpoints_mtp_layer_and_keeps_the_tokens(tmp_path, arch):
    """``nextn`` on a checkpoint with an MTP layer (Qwen3.5's ``mtp_num_hidden_layers``, Qwen3-Next's
    ``num_nextn_predict_layers``): drafts are made every step and the tokens are plain decoding's."""
    path = str(make_checkpoint(arch, tmp_path / arch, seed=3, mtp_layers=1, **DIMS))
    with Engine(path, **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    with Engine(path, **OPTS, speculative_algorithm="nextn", speculative_num_steps=2,
                speculative_draft_policy="fixed") as e:
        outs = e.generate(PROMPTS, GREEDY)
        counters = spec_counters(e)
        report = e.driver.idle_report()
        drafter = e.driver.executor.worker.runner.drafter
    assert [o.token_ids for o in outs] == ref
    assert drafter.graph_passes > 0  # the MTP layer's decode passes replay graphs beside the target's
    assert counters.verify_steps > 10 and counters.draft_tokens >= counters.verify_steps, counters
    assert (report.leaked_kv_slots, report.leaked_req_rows) == (0, 0)
