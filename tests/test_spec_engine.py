"""Speculative decoding (``speculative_algorithm="ngram"``) in the engine: greedy tokens equal those with it off
(and transformers'), on one rank and at dp=2 ep=2 with two-batch overlap, decode graphs and the low-latency
all-to-all (verify steps take it where they fit), for Qwen3-MoE and DeepSeek-V3 (MLA); drafts are accepted, and
nothing leaks."""

from __future__ import annotations

import dataclasses

import pytest
from hf_models import greedy_reference

from raymoe import Engine, SamplingParams
from raymoe.models.checkpoint import make_checkpoint
from raymoe.scheduler.spec_steps import SpecCounters

DIMS = {"num_layers": 3, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "moe_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 512}
# prompts that repeat themselves, so n-gram drafts exist from the first decode step on
PROMPTS = ["for i in range(10):\n    print(i)\n" * 3, "import os\nimport sys\n" * 4, "a = 1\nb = 2\na = 1\nb =",
           "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):\n", "x", "The end. The end. The"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
OPTS = {"max_running_requests": 4, "chunked_prefill_size": 16, "max_context_len": 160, "cuda_graph_max_bs": 4}
SPEC = {"speculative_algorithm": "ngram", "speculative_num_steps": 3}
TBO = {"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4}


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model_and_reference(request, tmp_path_factory):
    path = str(make_checkpoint(request.param, tmp_path_factory.mktemp("spec") / request.param, seed=3, **DIMS))
    with Engine(path, **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    return path, ref


def spec_counters(engine: Engine) -> SpecCounters:
    return SpecCounters.total(s.spec for s in engine.driver.group_stats())


def test_one_rank_gives_the_tokens_of_plain_decoding_and_transformers(model_and_reference):
    path, ref = model_and_reference
    with Engine(path, **OPTS, **SPEC) as e:
        assert e.driver.overlap_schedule  # between verify steps
        outs = e.generate(PROMPTS, GREEDY)
        counters = spec_counters(e)
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and counters.accepted_tokens > 0, counters
    assert sum(o.accepted_prediction_tokens for o in outs) == counters.accepted_tokens
    assert sum(o.rejected_prediction_tokens for o in outs) == counters.draft_tokens - counters.accepted_tokens
    assert report.clean
    if "qwen3" in path:
        assert ref[:2] == greedy_reference(path, PROMPTS[:2], GREEDY.max_tokens)


def test_overlap_scheduling_runs_between_verify_steps(model_and_reference):
    """Verify steps are formed from the previous step's result and finished before the next is formed; the plain
    steps between them overlap (rows with log-probs never verify: the adaptive policy stops asking for fresh
    tokens, and the driver sends each step while the one before runs)."""
    from raymoe.step.forward_mode import ForwardMode

    path, ref = model_and_reference
    with Engine(path, **OPTS, **SPEC) as e:
        ex, seen = e.driver.executor, {"running": 0, "verify_running": False, "sent_over_verify": 0}
        launch, collect = ex.launch, ex.collect

        def launching(batches):  # a step sent while a verify step still runs would be formed without its result
            seen["sent_over_verify"] += bool(seen["running"] and seen["verify_running"])
            seen["running"] += 1
            seen["verify_running"] = any(b.forward_mode == ForwardMode.TARGET_VERIFY or any(b.draft_lens)
                                         for b in batches)
            return launch(batches)

        def collecting(handle):
            seen["running"] -= 1
            return collect(handle)

        ex.launch, ex.collect = launching, collecting
        outs = e.generate(PROMPTS, GREEDY)
        verified = spec_counters(e).verify_steps
        before = e.driver.num_overlapped_steps
        with_logprobs = e.generate(PROMPTS, dataclasses.replace(GREEDY, logprobs=1))
        overlapped = e.driver.num_overlapped_steps - before
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs] == ref and [o.token_ids for o in with_logprobs] == ref
    assert verified > 0 and overlapped > 10, (verified, overlapped)
    assert seen["sent_over_verify"] == 0
    assert report.clean


def test_verify_steps_replay_decode_graphs_as_one_row_per_token(model_and_reference):
    """A verify step whose tokens fit a decode-graph bucket replays it, one decode row per token
    (``raymoe.runner.token_rows``; GQA through the CPU decode kernel, MLA through the absorbed decode), and keeps
    plain decoding's tokens."""
    path, ref = model_and_reference
    with Engine(path, **{**OPTS, "cuda_graph_max_bs": 16}, **SPEC, speculative_draft_policy="fixed") as e:
        outs = e.generate(PROMPTS, GREEDY)
        counters = spec_counters(e)
        verify_graphs = e.driver.executor.worker.runner.verify_graph_steps
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and counters.accepted_tokens > 0 and verify_graphs > 0, (counters, verify_graphs)
    assert report.clean


def test_dp2_ep2_with_tbo_graphs_and_low_latency_dispatch(ray_cluster, model_and_reference):
    path, ref = model_and_reference
    with Engine(path, dp_size=2, ep_size=2, **OPTS, **TBO, **SPEC) as e:
        decide, verify_capacities = e.driver._decide, []

        def watched(plans):  # TBO and dispatch capacity of every step in which a group verified drafts
            decision, mode = decide(plans)
            if mode == "verify":
                verify_capacities.append((decision.use_tbo, decision.dispatch_capacity))
            return decision, mode

        e.driver._decide = watched
        outs = e.generate(PROMPTS, GREEDY)
        counters = spec_counters(e)
        graph_steps, ll_steps = e.driver.num_graph_steps, e.driver.num_low_latency_steps
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and counters.accepted_tokens > 0, counters
    assert ll_steps > 0 and graph_steps > 0
    # verify steps split by sequence under TBO (normal dispatch then), low-latency dispatch otherwise
    assert any(tbo for tbo, _ in verify_capacities), verify_capacities
    assert all((c is None) == tbo for tbo, c in verify_capacities), verify_capacities
    assert report.clean


def test_seeded_sampling_continues_from_seed_and_position(tiny_model):
    """A seeded sampled request gives the same tokens alone and beside others with speculation on."""
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=7)
    with Engine(tiny_model, **SPEC) as e:
        alone = e.generate([PROMPTS[0]], params)[0].token_ids
        together = e.generate(PROMPTS[:3], [params, GREEDY, SamplingParams(max_tokens=9, temperature=1.0)])
    assert together[0].token_ids == alone and len(alone) == 20


def test_recurrent_models_refuse_nextn_without_an_mtp_layer(tmp_path):
    """Hybrid models verify ngram drafts, and nextn drafts with their checkpoint's MTP layer
    (``tests/test_hybrid_spec.py``); a checkpoint without one refuses ``nextn`` by name."""
    from raymoe.errors import InvalidRequestError

    path = str(make_checkpoint("qwen3_5_moe", tmp_path / "q35", seed=1, num_layers=4, hidden_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=16, moe_intermediate_size=32, vocab_size=512))
    with pytest.raises(InvalidRequestError) as err:
        Engine(path, speculative_algorithm="nextn")
    assert err.value.field == "speculative_algorithm"


def test_served_streams_with_speculation_and_exports_its_metrics(ray_cluster, model_and_reference):
    """``raymoe serve``'s engine (dp=2 ep=2, the driver actor) with ``--speculative-algorithm ngram`` streams the
    tokens of plain decoding (several per delta where drafts were accepted), and ``/metrics`` carries the
    acceptance counters and histogram."""
    import asyncio

    import ray

    from raymoe.client.engine_client import EngineClient
    from raymoe.deploy.metrics import ServerMetrics
    from raymoe.deploy.server_config import ServeOptions

    path, ref = model_and_reference
    opts = ServeOptions(model=path, max_running_requests=4, max_context_len=160, speculative_algorithm="ngram",
                        speculative_num_steps=3, speculative_draft_policy="fixed")  # plumbing, not the policy
    client = EngineClient(opts.engine_config(path))
    try:
        async def run(i, prompt):
            out, widest, accepted = [], 0, 0
            async for d in client.generate(f"r{i}", client.tokenizer.encode(prompt), GREEDY):
                out += d.token_ids
                widest = max(widest, len(d.token_ids))
                accepted = d.accepted_prediction_tokens  # the last delta carries the request's counts
            return out, widest, accepted

        async def main():
            return await asyncio.gather(*(run(i, p) for i, p in enumerate(PROMPTS)))

        results = asyncio.run(main())
        assert [r[0] for r in results] == ref
        assert max(r[1] for r in results) > 1  # accepted drafts arrive together
        stats = ray.get(client.driver.stats.remote(), timeout=30)
        assert stats.spec is not None and stats.spec.accepted_tokens > 0
        assert sum(r[2] for r in results) == stats.spec.accepted_tokens  # usage: accepted_prediction_tokens
        text = ServerMetrics("m").render(stats).decode()
        assert "raymoe:spec_accepted_tokens" in text and "raymoe:spec_accept_length_bucket" in text

        import httpx
        from server_harness import metrics, uvicorn_server

        from raymoe.deploy.openai_api import build_openai_app

        with uvicorn_server(build_openai_app(client)) as url:  # the OpenAI API over the same engine
            accepted = 0
            for prompt in PROMPTS:
                usage = httpx.post(f"{url}/v1/completions", timeout=60, json={
                    "model": client.model_name, "prompt": prompt, "max_tokens": 48, "temperature": 0,
                    "ignore_eos": True}).json()["usage"]
                assert usage["completion_tokens"] == 48  # unchanged in meaning
                details = usage.get("completion_tokens_details")  # present where drafts were verified
                if details is not None:
                    assert details["rejected_prediction_tokens"] >= 0
                    accepted += details["accepted_prediction_tokens"]
            assert accepted > 0 and metrics(url)["raymoe:spec_accepted_tokens_total"] > 0
    finally:
        client.shutdown()


def trained_in_a_fresh_process(code: str) -> None:
    """Run ``code`` (it builds and trains a tiny checkpoint) in a new interpreter: the trained weights then do not
    depend on what earlier tests left in this process (in-process runs of the same seeded training gave different
    weights depending on the tests before them, and with them drafts that were accepted or never)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny DeepSeek-V3 trained briefly with its MTP layer (``raymoe.models.train_demo``), and the engine's
    greedy tokens without speculation."""
    path = tmp_path_factory.mktemp("mtp") / "ds"
    trained_in_a_fresh_process(
        "from raymoe.models.checkpoint import make_checkpoint\n"
        "from raymoe.models.train_demo import train_checkpoint\n"
        f"p = make_checkpoint('deepseek_v3', {str(path)!r}, seed=2, **{DIMS!r})\n"
        "train_checkpoint(p, 0.0, steps=300, seq_len=48, batch_size=8, progress=False)\n")
    with Engine(str(path), **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, LONG)]
    return str(path), ref


# every request decodes its 24 tokens; no MIXED steps, so the drafts are verified in TARGET_VERIFY steps
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NO_MIXED = {**OPTS, "enable_mixed_chunk": False}
# drafts verified whatever their acceptance (the adaptive policy would stop verifying a barely trained layer's)
NEXTN = {"speculative_algorithm": "nextn", "speculative_num_steps": 3, "speculative_draft_policy": "fixed"}


def test_nextn_drafts_with_the_mtp_layer_and_keeps_the_tokens(mtp_model):
    path, ref = mtp_model
    with Engine(path, **NO_MIXED, **NEXTN) as e:
        outs = e.generate(PROMPTS, LONG)
        # a second wave hits the radix cache (cut by one token: the MTP entry of a cached position)
        again = e.generate(PROMPTS[:2], LONG)
        counters = spec_counters(e)
        report = e.driver.idle_report()
        drafter = e.driver.executor.worker.runner.drafter
        graph_steps = e.driver.num_graph_steps
        verify_graphs = e.driver.executor.worker.runner.verify_graph_steps
    assert [o.token_ids for o in outs] == ref and [o.token_ids for o in again] == ref[:2]
    assert counters.verify_steps > 0 and counters.accepted_tokens > 0, counters
    # decode steps replay the target's graphs (which return the hidden states the MTP layer reads), verify steps
    # replay them as one row per token where the bucket holds their tokens, and the MTP layer's decode passes replay
    # graphs of their own; a prefill's draft extend stays eager
    assert graph_steps > 0 and verify_graphs > 0 and drafter.graph_passes > 0 and drafter.eager_passes > 0
    assert report.clean
    with Engine(path, **NO_MIXED, **NEXTN, disable_cuda_graph=True) as e:  # the same drafts without graphs
        e.generate(PROMPTS, LONG)
        e.generate(PROMPTS[:2], LONG)
        assert spec_counters(e) == counters and e.driver.executor.worker.runner.drafter.graph_passes == 0
    with Engine(path, **OPTS, **NEXTN) as e:  # MIXED steps on: their decode rows verify the MTP drafts too
        assert [o.token_ids for o in e.generate(PROMPTS, LONG)] == ref
        assert e.driver.idle_report().clean


def test_nextn_at_dp2_ep2_with_idle_groups_and_tbo(ray_cluster, mtp_model):
    """Every rank runs every MTP pass (IDLE groups with no tokens), so the MTP layer's MoE collectives pair up."""
    path, ref = mtp_model
    with Engine(path, dp_size=2, ep_size=2, **NO_MIXED, **TBO, **NEXTN) as e:
        outs = e.generate(PROMPTS, LONG)
        lone = e.generate(PROMPTS[:1], LONG)  # one group idles while the other decodes
        counters = spec_counters(e)
        report = e.driver.idle_report()
        graph_steps, ll_steps = e.driver.num_graph_steps, e.driver.num_low_latency_steps
    assert [o.token_ids for o in outs] == ref and lone[0].token_ids == ref[0]
    assert counters.accepted_tokens > 0 and report.clean
    assert graph_steps > 0 and ll_steps > 0  # graphs of the target and of the MTP passes, low-latency dispatch


def test_nextn_needs_an_mtp_layer(tiny_model):
    from raymoe.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        Engine(tiny_model, **NEXTN)
    assert err.value.field == "speculative_algorithm"


@pytest.fixture(scope="module")
def eagle_model(tmp_path_factory):
    """A tiny Qwen3-MoE target, an EAGLE head trained for it (``train_eagle_head``), and the target's greedy
    tokens."""

    root = tmp_path_factory.mktemp("eagle")
    target = make_checkpoint("qwen3_moe", root / "target", seed=3, **DIMS)
    trained_in_a_fresh_process(
        "from raymoe.models.train_eagle import train_eagle_head\n"
        f"r = train_eagle_head({str(target)!r}, {str(root / 'head')!r}, 0.0, steps=150, seq_len=48, batch_size=8, "
        "progress=False)\n"
        "assert r.final_loss < r.losses[0][1]\n")
    with Engine(str(target), **OPTS) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, LONG)]
    return str(target), str(root / "head"), ref


def test_eagle_head_drafts_and_keeps_the_tokens(eagle_model):
    target, head, ref = eagle_model
    eagle = {**NEXTN, "speculative_algorithm": "eagle", "speculative_draft_model_path": head}
    with Engine(target, **NO_MIXED, **eagle) as e:
        outs = e.generate(PROMPTS, LONG)
        counters = spec_counters(e)
        report = e.driver.idle_report()
        drafter = e.driver.executor.worker.runner.drafter
    assert [o.token_ids for o in outs] == ref
    assert counters.verify_steps > 0 and counters.accepted_tokens > 0, counters
    assert drafter.graph_passes > 0 and report.clean


def test_eagle_at_dp2_ep2_with_tbo(ray_cluster, eagle_model):
    target, head, ref = eagle_model
    eagle = {**NEXTN, "speculative_algorithm": "eagle", "speculative_draft_model_path": head}
    with Engine(target, dp_size=2, ep_size=2, **NO_MIXED, **TBO, **eagle) as e:
        outs = e.generate(PROMPTS, LONG)
        counters = spec_counters(e)
        report = e.driver.idle_report()
    assert [o.token_ids for o in outs] == ref
    assert counters.accepted_tokens > 0 and report.clean


def test_eagle_needs_a_head_folder(tiny_model, tmp_path):
    from raymoe.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        Engine(tiny_model, speculative_algorithm="eagle")
    assert err.value.field == "speculative_draft_model_path"
    with pytest.raises(InvalidRequestError) as err:
        Engine(tiny_model, speculative_algorithm="eagle", speculative_draft_model_path=str(tmp_path))
    assert err.value.field == "speculative_draft_model_path"


def test_group_scheduler_processes_speculate_too(ray_cluster, model_and_reference):
    """``group_schedulers="actors"`` (one scheduler process per DP group): each group forms its own verify steps and
    applies what its ranks accepted; the tokens are plain decoding's and the counters reach the driver."""
    import asyncio

    import ray

    from raymoe.client.engine_client import EngineClient
    from raymoe.config import engine_config_from_options

    path, ref = model_and_reference
    config = engine_config_from_options(path, {"dp_size": 2, "ep_size": 2, "group_schedulers": "actors",
                                               "device": "cpu", **OPTS, **SPEC})
    client = EngineClient(config)
    try:
        async def run(i, prompt):
            out = []
            async for d in client.generate(f"g{i}", client.tokenizer.encode(prompt), GREEDY):
                out += d.token_ids
            return out

        async def main():
            return await asyncio.gather(*(run(i, p) for i, p in enumerate(PROMPTS)))

        assert asyncio.run(main()) == ref
        stats = ray.get(client.driver.stats.remote(), timeout=30)
        assert stats.spec is not None and stats.spec.accepted_tokens > 0
    finally:
        client.shutdown()
