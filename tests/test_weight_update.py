"""Weight updates from disk (``raymoe.actors.weight_update``): the served model switches to another checkpoint of
the same architecture in place, as an RL loop does between rollouts.

Offline (one rank, this process, decode graphs on): after an update the greedy tokens are a fresh engine's on the
new checkpoint (the prompts were cached under the old weights, so a cache that was not flushed shows), and back
again; another architecture is refused naming the field; a checkpoint that fails half-way is rolled back. Served
(dp=2 ep=2, a scheduler process per DP group, HTTP): a stream running when the update arrives finishes on the old
weights, a request sent meanwhile waits and runs on the new ones, ``abort_all_requests`` ends the running stream,
and the errors are 400s naming the field.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import httpx
import pytest
from server_harness import metrics, uvicorn_server, wait_for

PROMPTS = ["def foo(x):\n    return", "import os\nimport sys\n\nclass Thing:"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model):
    """The session's tiny Qwen3-MoE (seed 0), the same architecture with seed 1, one with 16 experts, and seed 1
    with the last layer's last expert missing."""
    import safetensors.torch

    from raymoe.models.checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("weights")
    b = str(make_checkpoint("qwen3_moe", root / "b", seed=1))
    wide = str(make_checkpoint("qwen3_moe", root / "wide", seed=1, num_experts=16))
    broken = root / "broken"
    shutil.copytree(b, broken)
    tensors = safetensors.torch.load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.3.mlp.experts.7.down_proj.weight"]
    safetensors.torch.save_file(tensors, str(broken / "model.safetensors"))
    return {"a": tiny_model, "b": b, "wide": wide, "broken": str(broken)}


def _params():
    from raymoe.scheduler.sampling_params import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _tokens(engine) -> list[list[int]]:
    return [list(o.token_ids) for o in engine.generate(PROMPTS, _params())]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Greedy tokens of fresh one-rank engines on checkpoints a and b (the engine's parity with transformers and
    across topologies is tested elsewhere)."""
    from raymoe.engine import Engine

    out = {}
    for name in ("a", "b"):
        with Engine(checkpoints[name]) as e:
            out[name] = _tokens(e)
    assert out["a"] != out["b"]
    return out


def test_an_update_serves_the_new_weights_and_flushes_the_cache(checkpoints, reference):
    from raymoe.engine import Engine

    with Engine(checkpoints["a"]) as e:
        assert e.driver.executor.worker.runner.graph_runner is not None
        assert _tokens(e) == reference["a"]  # the prompts are now cached under a's weights
        r = e.update_weights_from_disk(checkpoints["b"], weight_version="step-1")
        assert r.success and r.weight_version == e.weight_version == "step-1", r
        assert _tokens(e) == reference["b"]
        r = e.update_weights_from_disk(checkpoints["a"])
        assert r.success and r.weight_version == "step-1"  # None keeps the name
        assert _tokens(e) == reference["a"]
        idle = e.driver.idle_report()
        assert (idle.leaked_kv_slots, idle.leaked_req_rows, idle.locked_cache_tokens) == (0, 0, 0)
        e.driver.executor.restart()  # a rebuild after a fault loads the folder serving now
        e.update_weights_from_disk(checkpoints["b"])
        e.driver.executor.restart()
        e.driver.reset()
        assert _tokens(e) == reference["b"]


def test_another_architecture_or_a_broken_folder_leaves_the_weights_as_they_were(checkpoints, reference):
    from raymoe.engine import Engine

    with Engine(checkpoints["a"]) as e:
        r = e.update_weights_from_disk(checkpoints["wide"], weight_version="wide")
        assert not r.success and r.param == "model_path" and "num_experts is 16" in r.message, r
        assert r.seconds == 0.0 and e.weight_version == "default"
        r = e.update_weights_from_disk(checkpoints["a"] + "-missing")
        assert not r.success and r.param == "model_path" and "does not exist" in r.message, r
        # Layers 0-2 load before layer 3's missing tensor: the ranks load a again.
        r = e.update_weights_from_disk(checkpoints["broken"], weight_version="broken")
        assert not r.success and r.param == "model_path", r
        assert "model.layers.3.mlp.experts.7.down_proj.weight" in r.message and "serve" in r.message
        assert e.weight_version == "default"
        assert _tokens(e) == reference["a"]
        assert e.driver.executor.runner_cfg.model_path == checkpoints["a"]


# --------------------------------------------------------------------------------------------------------- served
ENGINE_NAME = "weight-update-test"


@pytest.fixture(scope="module")
def served(ray_cluster, checkpoints):
    from raymoe.client.engine_client import EngineClient
    from raymoe.deploy.openai_api import build_openai_app
    from raymoe.engine import _split_options

    engine = EngineClient(_split_options(checkpoints["a"], {"dp_size": 2, "ep_size": 2,
                                                            "group_schedulers": "actors"}), engine_name=ENGINE_NAME)
    try:
        with uvicorn_server(build_openai_app(engine, api_key="k")) as url:
            yield engine, url
    finally:
        engine.shutdown()


AUTH = {"Authorization": "Bearer k"}


def _complete(url: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _text(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def _running(url: str) -> bool:
    return metrics(url)["raymoe:num_requests_running"] > 0


def _update(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/update_weights_from_disk", json=body, headers=AUTH, timeout=300)


def test_a_served_update_waits_for_the_running_stream_and_holds_new_requests(served, checkpoints, reference):
    engine, url = served
    model = engine.model_name
    assert httpx.get(f"{url}/get_weight_version", headers=AUTH).json() == {"weight_version": "default"}
    results: dict[str, object] = {}

    def run(name, fn):
        results[name] = fn()

    # A long request on a, running when the update arrives: it finishes on a's weights, never mixed.
    running = threading.Thread(target=run, args=("running", lambda: _complete(url, model, PROMPTS[0], 1000)))
    running.start()
    wait_for(lambda: _running(url), timeout_s=60)
    update = threading.Thread(target=run, args=("update", lambda: _update(url, model_path=checkpoints["b"],
                                                                         weight_version="rollout-2")))
    update.start()
    time.sleep(0.5)
    held = threading.Thread(target=run, args=("held", lambda: _complete(url, model, PROMPTS[1])))
    held.start()
    time.sleep(0.5)
    assert running.is_alive() and update.is_alive()  # the held request arrived while the update waited
    for t in (running, update, held):
        t.join(timeout=240)
    r = results["update"]
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == "rollout-2", r.text
    assert results["running"]["text"].startswith(_text(engine, reference["a"][0]))
    assert results["running"]["finish_reason"] == "length"
    assert results["held"]["text"] == _text(engine, reference["b"][1])
    assert _complete(url, model, PROMPTS[0])["text"] == _text(engine, reference["b"][0])
    assert httpx.get(f"{url}/get_weight_version", headers=AUTH).json() == {"weight_version": "rollout-2"}
    m = metrics(url)
    assert m["raymoe:weight_version_info{weight_version=rollout-2}"] == 1 and m["raymoe:weight_updates_total"] == 1

    # abort_all_requests ends what runs; errors name the field; back to a.
    running = threading.Thread(target=run, args=("running", lambda: _complete(url, model, PROMPTS[0], 2000)))
    running.start()
    wait_for(lambda: _running(url), timeout_s=60)
    r = _update(url, model_path=checkpoints["a"], abort_all_requests=True)
    running.join(timeout=120)
    assert r.status_code == 200 and r.json()["num_aborted_requests"] == 1, r.text
    assert results["running"]["finish_reason"] == "abort"
    assert [_complete(url, model, p)["text"] for p in PROMPTS] == [_text(engine, ids) for ids in reference["a"]]
    r = _update(url, model_path=checkpoints["wide"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text
    assert "num_experts" in r.json()["error"]["message"]
    r = _update(url, model_path=checkpoints["b"], flush_cache=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "flush_cache", r.text
    assert httpx.post(f"{url}/update_weights_from_disk", json={"model_path": checkpoints["b"]}).status_code == 401
    assert [_complete(url, model, p)["text"] for p in PROMPTS] == [_text(engine, ids) for ids in reference["a"]]





def test_retracted_requests_go_on_with_the_new_weights(served, checkpoints):
    """``retract_requests``: the running request leaves the engine, the front end submits it again with the tokens
    it delivered, and the rest of its tokens are the new weights' greedy continuation of prompt + those tokens."""
    import asyncio

    from raymoe.engine import Engine
    from raymoe.scheduler.sampling_params import SamplingParams

    engine, url = served
    prompt = engine.tokenizer.encode(PROMPTS[0])
    n = 600
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    got: list[int] = []
    box: dict = {}

    async def collect():
        async for delta in engine.generate("retracted-1", prompt, params):
            got.extend(delta.token_ids)
            box["last"] = delta

    stream = threading.Thread(target=lambda: asyncio.run(collect()))
    resumed = engine.resumed_requests
    stream.start()
    wait_for(lambda: len(got) >= 8, timeout_s=60)
    r = _update(url, model_path=checkpoints["b"], retract_requests=True)
    stream.join(timeout=120)
    try:
        assert r.status_code == 200 and r.json()["num_retracted_requests"] == 1, r.text
        assert box["last"].finish_reason == "length" and len(got) == n
        assert engine.resumed_requests == resumed + 1
        with Engine(checkpoints["a"]) as e:
            ref_a = list(e.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids)
        k = next((i for i, (x, y) in enumerate(zip(got, ref_a, strict=True)) if x != y), n)
        assert 8 <= k < n  # tokens from a's weights, then b's
        with Engine(checkpoints["b"]) as e:
            rest = SamplingParams(max_tokens=n - k, temperature=0.0, ignore_eos=True)
            assert got[k:] == list(e.generate(prompt_token_ids=[prompt + got[:k]], sampling_params=rest)[0].token_ids)
        r = _update(url, model_path=checkpoints["b"], abort_all_requests=True, retract_requests=True)
        assert r.status_code == 400 and r.json()["error"]["param"] == "retract_requests", r.text
    finally:
        assert _update(url, model_path=checkpoints["a"]).status_code == 200


def test_a_named_engine_takes_tensors_from_a_ray_program_and_rebuilt_ranks_load_them(served, checkpoints,
                                                                                      reference):
    """``raymoe.client.weight_sync.update_weights_from_tensors`` by the engine's name: b's tensors go through the
    object store (a copy the driver actor owns) to every rank; after the ranks are killed the rebuilt ranks fetch
    the same reference and serve b's tokens again."""
    import ray

    from raymoe.client.weight_sync import update_weights_from_tensors

    engine, url = served
    model = engine.model_name
    want = [_text(engine, ids) for ids in reference["b"]]
    try:
        r = update_weights_from_tensors(ENGINE_NAME, _state_dict(checkpoints["b"]), "tensors-b")
        assert r.success and r.weight_version == "tensors-b", r
        assert [_complete(url, model, p)["text"] for p in PROMPTS] == want
        # Every rank at once, while idle: the next step's launch finds them gone (a rank fault, rebuilt at once).
        for pid in ray.get([r.pid.remote() for r in ray.get(engine.driver.rank_actors.remote())]):
            os.kill(pid, signal.SIGKILL)
        assert [_complete(url, model, p)["text"] for p in PROMPTS] == want  # rebuilt from the reference
        assert ray.get(engine.driver.stats.remote()).rank_restarts == 1
    finally:
        assert _update(url, model_path=checkpoints["a"]).status_code == 200

def _tensors(model) -> dict:
    """Every parameter and buffer of ``model``, and of its MTP draft layer (held outside its module tree)."""
    out = dict(model.state_dict())
    if getattr(model, "mtp", None) is not None:
        out.update({f"mtp.{k}": v for k, v in model.mtp.state_dict().items()})
    return out


SMALL = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
         "moe_intermediate_size": 32, "vocab_size": 512}


@pytest.mark.parametrize("arch, build, opts", [
    ("deepseek_v3", {"quant": "fp8"}, {}),
    ("qwen3_5_moe", {"mtp_layers": 1, **SMALL}, {"speculative_algorithm": "nextn", "speculative_num_steps": 1}),
], ids=["deepseek_v3_fp8", "qwen3_5_moe_nextn"])
def test_every_tensor_is_the_new_checkpoints(tmp_path, arch, build, opts):
    """After an update every parameter and buffer equals a fresh engine's on the new folder, and so do the greedy
    tokens: DeepSeek-V3 with FP8 block-quantized weights (weights and scales, MLA), and Qwen3.5-MoE (hybrid linear
    attention) with its MTP layer drafting (``nextn``: the draft model's tensors too)."""
    import torch

    from raymoe.engine import Engine
    from raymoe.models.checkpoint import make_checkpoint

    a, b = (str(make_checkpoint(arch, tmp_path / n, seed=s, **build)) for n, s in (("a", 0), ("b", 1)))
    with Engine(b, **opts) as fresh:
        want = {k: v.clone() for k, v in _tensors(fresh.driver.executor.worker.runner.model).items()}
        ref_b = _tokens(fresh)
    assert not opts or any(k.startswith("mtp.") for k in want)
    with Engine(a, **opts) as e:
        model = e.driver.executor.worker.runner.model
        assert _tokens(e) != ref_b
        assert e.update_weights_from_disk(b).success
        got = _tensors(model)
        assert got.keys() == want.keys()
        differ = [k for k in want if not torch.equal(got[k], want[k])]
        assert not differ, differ[:5]
        assert _tokens(e) == ref_b


def _state_dict(path: str) -> dict:
    import safetensors.torch

    return safetensors.torch.load_file(f"{path}/model.safetensors")


def test_an_update_from_tensors_serves_them_and_survives_a_rank_rebuild(checkpoints, reference):
    """``update_weights_from_tensors``: b's tensors in memory serve as b's folder does; a rank rebuilt after a
    fault loads them again (over the folder it started from); a mapping missing a tensor is refused naming it, and
    the ranks go back to the tensors they served."""
    from raymoe.engine import Engine

    b = _state_dict(checkpoints["b"])
    with Engine(checkpoints["a"]) as e:
        assert _tokens(e) == reference["a"]
        r = e.update_weights_from_tensors(b, weight_version="t1")
        assert r.success and e.weight_version == "t1", r
        assert _tokens(e) == reference["b"]
        e.driver.executor.restart()
        e.driver.reset()
        assert _tokens(e) == reference["b"]
        partial = {k: v for k, v in b.items() if k != "model.layers.3.mlp.gate.weight"}
        r = e.update_weights_from_tensors(partial, weight_version="t2")
        assert not r.success and r.param == "tensors" and "model.layers.3.mlp.gate.weight" in r.message, r
        assert e.weight_version == "t1" and _tokens(e) == reference["b"]
        assert e.update_weights_from_disk(checkpoints["a"]).success
        assert e.driver.executor.runner_cfg.weight_tensors is None
        assert _tokens(e) == reference["a"]
