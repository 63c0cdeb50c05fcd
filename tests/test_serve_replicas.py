"""Several engines behind one front end on Ray Serve (``build_app(engine_replicas=2)``): the ingress deployment
tokenizes and calls two engine replicas (each a whole dp=1 engine) through a handle whose request router picks the
engine caching the longest prefix (``raymoe.deploy.serve_router``).

Checked on the session cluster: every turn of several multi-turn chats is served from the cache of the replica
that served the conversation's earlier turns (cached tokens >= the previous turn's whole prompt); both replicas
report their cached prefixes to the router; a client that hangs up mid-stream leaves no request running on any
replica; a bad request is answered 400 by the ingress. The router's bookkeeping itself (reports replacing guesses,
the load bound) is checked without Serve, and raymoe's errors survive pickling as themselves (an engine replica's
refusal reaches the ingress through the handle as the ``InvalidRequestError`` it is, so the client gets its 400).
"""

from __future__ import annotations

import pickle

import httpx
import pytest
from server_harness import wait_for

from raymoe.cluster.bootstrap import free_port
from raymoe.deploy.serve_router import ReplicaPrefixIndex
from raymoe.errors import (
    CheckpointError,
    ContextLengthError,
    EngineUnhealthyError,
    InvalidRequestError,
    RequestFailedError,
)
from raymoe.kvcache.prefix_events import block_hashes


@pytest.mark.parametrize("error", [InvalidRequestError("queue", "the queue is full"),
                                   ContextLengthError("prompt", "too long"), EngineUnhealthyError("a rank died"),
                                   CheckpointError("/models/x", "no config.json"), RequestFailedError("sampling")])
def test_errors_cross_processes_as_themselves(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert getattr(again, "field", None) == getattr(error, "field", None)


def test_a_routed_prompt_counts_until_a_later_report_replaces_it():
    index = ReplicaPrefixIndex()
    prompt = block_hashes(list(range(64)))  # 4 blocks
    index.report("a", [], at=10.0)
    index.report("b", [], at=10.0)
    assert index.choose(["a", "b"], prompt).group == 0  # nothing cached: least loaded, lowest index
    index.routed("r1", "b", prompt)
    assert index.cached_tokens("b", prompt) == 64 and index.load("b") == 1
    assert index.choose(["a", "b"], prompt).group == 1  # the routed prompt counts as cached on b
    index.completed("r1", now=11.0)
    index.report("b", prompt[:2], at=10.5)  # made before r1 completed: the guess stays
    assert index.cached_tokens("b", prompt) == 64
    index.report("b", prompt[:2], at=12.0)  # after: the replica's own word (it evicted the tail)
    assert index.cached_tokens("b", prompt) == 32 and index.load("b") == 0
    index.report("b", prompt, at=11.0)  # older than what we have: ignored
    assert index.cached_tokens("b", prompt) == 32
    index.routed("r2", "a", prompt)
    index.move("r2", "b")  # Serve fell back to another replica: the request moves
    assert (index.load("a"), index.load("b")) == (0, 1) and index.cached_tokens("a", prompt) == 0
    index.prune(["a"])
    assert index.cached_tokens("b", prompt) == 0


def test_the_load_bound_holds_across_replicas():
    index = ReplicaPrefixIndex(max_load_ratio=1.25)
    prompt = block_hashes(list(range(64)))
    index.report("a", prompt, at=1.0)
    placed = {"a": 0, "b": 0}
    for i in range(40):
        name = ["a", "b"][index.choose(["a", "b"], prompt).group]
        index.routed(f"r{i}", name, prompt)
        placed[name] += 1
        assert max(placed.values()) <= -(-1.25 * sum(placed.values()) // 2)
    assert placed["b"] > 0  # over the bound on a; from then on b holds the prefix as well (routed there)


@pytest.fixture(scope="module")
def two_engines(ray_cluster, tiny_model):
    from ray import serve

    from raymoe.deploy.serve_app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = build_app({"model": tiny_model, "served_model_name": "tiny", "dp_size": 1, "ep_size": 1,
                     "max_running_requests": 8, "engine_replicas": 2})
    serve.run(app, name="raymoe-replicas", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, timeout_s=240, interval_s=1.0)
        yield url
    finally:
        serve.delete("raymoe-replicas")
        serve.shutdown()


def _chat(url: str, messages: list[dict]) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_each_turn_is_served_from_the_cache_of_its_conversations_replica(two_engines):
    from ray import serve

    system = {"role": "system", "content": "You answer in Python. " + "def f(x): return x * 2\n" * 6}
    for c in range(4):
        history = [system]
        previous_prompt = 0
        for t in range(3):
            history.append({"role": "user", "content": f"conversation {c} turn {t}: what does f({c}{t}) return?"})
            out = _chat(two_engines, history)
            usage = out["usage"]
            if t > 0:  # the previous turn's prompt (and its answer) are cached where the router sends this turn
                assert usage["prompt_tokens_details"]["cached_tokens"] >= previous_prompt, (c, t, usage)
            previous_prompt = usage["prompt_tokens"]
            history.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})

    handle = serve.get_deployment_handle("raymoe-engine", app_name="raymoe-replicas")
    reports = [handle.record_routing_stats.remote().result(timeout_s=60) for _ in range(8)]
    assert any(len(r["blocks"]) > 0 for r in reports)


def test_a_client_that_hangs_up_leaves_nothing_running_and_refusals_are_openai_errors(two_engines):
    from ray import serve

    body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{two_engines}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    handle = serve.get_deployment_handle("raymoe-engine", app_name="raymoe-replicas")

    def all_idle() -> bool:
        stats = [handle.stats.remote().result(timeout_s=60) for _ in range(8)]  # both replicas, by chance
        return all(s.num_running == 0 and s.num_waiting == 0 for s in stats)

    wait_for(all_idle, timeout_s=30, interval_s=0.5)  # TimeoutError: a request kept running after its client left

    r = httpx.post(f"{two_engines}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [10_000_000], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"], r.text
