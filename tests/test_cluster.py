"""Multi-rank engine on Ray: TP + EP + DP-attention parity with the single-rank engine, multi-node placement,
and rank failure handling."""

from __future__ import annotations

import time

import pytest

from raymoe import Engine, EngineUnhealthyError, SamplingParams

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Foo(object):\n    pass\n", "x = [i * i for i in",
           "# Licensed under the Apache License", "return self._cache[key]"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def single_rank(tiny_model):
    with Engine(tiny_model) as e:
        yield e


@pytest.fixture(scope="module")
def reference(single_rank):
    return {p: o.token_ids for p, o in zip(PROMPTS, single_rank.generate(PROMPTS, GREEDY), strict=True)}


def run_staggered(engine: Engine, prompts: list[str]) -> dict[str, list[int]]:
    """Requests arrive in waves so some DP groups prefill while others decode (and some steps idle a group)."""
    d = engine.driver
    reqs = {}
    for wave in (prompts[:1], prompts[1:3], prompts[3:]):
        for p in wave:
            reqs[p] = d.add_request(d.new_rid(), engine.encode(p), GREEDY)
        for _ in range(3):
            d.step()
    while d.has_unfinished():
        d.step()
    return {p: r.output_ids for p, r in reqs.items()}


@pytest.mark.parametrize(("tp", "dp", "ep"), [(2, 1, 1), (1, 2, 2), (2, 2, 4), (1, 4, 4)])
def test_topologies_match_single_rank(ray_cluster, tiny_model, reference, tp, dp, ep):
    with Engine(tiny_model, tp_size=tp, dp_size=dp, ep_size=ep) as e:
        # Fewer prompts than DP groups: at least one group runs IDLE batches (dp=4).
        few = e.generate(PROMPTS[:3], GREEDY)
        assert [o.token_ids for o in few] == [reference[p] for p in PROMPTS[:3]]
        staggered = run_staggered(e, PROMPTS)
        idle_steps = e.driver.num_idle_group_steps
    assert staggered == reference
    if dp > 1:
        assert idle_steps > 0


def test_multi_node_placement(ray_cluster, tiny_model, reference):
    """dp=2 x tp=2 on the session cluster (three nodes declaring 2 GPUs each): each TP group is one STRICT_PACK
    placement group of GPU bundles, so it fills one node's GPUs and the two DP groups land on two different
    nodes; greedy tokens match a single rank.
    ``bundle_gpus=True`` with CPU compute: the emulated nodes have no CUDA, and a rank configured for CUDA
    without a GPU refuses to start (tests/test_rank_device.py). Each rank's CUDA device is bound from Ray's
    assignment (``raymoe.actors.rank_devices``): its node's GPUs visible, its own at index ``LOCAL_RANK``."""
    import os

    import ray

    def cuda_device(_worker) -> tuple[str, str, str]:  # nested: Ray ships it by value (no test module import)
        return os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"], str(ray.get_gpu_ids()[0])

    with Engine(tiny_model, tp_size=2, dp_size=2, ep_size=4, device="cpu", bundle_gpus=True) as e:
        nodes = ray.get([w.node_id.remote() for w in e.driver.executor.workers])
        devices = ray.get([w.__ray_call__.remote(cuda_device) for w in e.driver.executor.workers])
        pg_ids = {p.pg.id.hex() for p in e.driver.executor.placements}
        table = [t for pid, t in ray.util.placement_group_table().items() if pid in pg_ids]
        outs = e.generate(PROMPTS[:2], GREEDY)
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], nodes
    assert nodes[0] != nodes[2], "the two TP groups should sit on different nodes"
    gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 2}
    assert len(gpu_nodes) == 3 and set(nodes) <= gpu_nodes, "three nodes declare 2 GPUs each"
    assert len(table) == 2
    for t in table:
        assert t["strategy"] == "STRICT_PACK" and t["state"] == "CREATED"
        assert [b.get("GPU") for b in t["bundles"].values()] == [1.0, 1.0]
        assert len(set(t["bundles_to_node_id"].values())) == 1
    # each rank sees its node's two GPUs (in rank order) and takes its own: local rank 0, 1 on each node
    assert [index for _, index, _ in devices] == ["0", "1", "0", "1"], devices
    assert all(sorted(visible.split(",")) == ["0", "1"] and visible.split(",")[int(index)] == own
               for visible, index, own in devices), devices
    assert devices[0][0] == devices[1][0] and devices[2][0] == devices[3][0]
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS[:2]]


class _Collector:
    """A DriverService ``publish`` target: routes each published batch's deltas to per-request lists (on the
    loop thread) and counts the batches."""

    def __init__(self):
        self.deltas: dict[str, list] = {}
        self.num_batches = 0

    def __call__(self, batch) -> None:
        self.num_batches += 1
        for d in batch:
            self.deltas.setdefault(d.request_id, []).append(d)

    def finished(self, rid: str) -> bool:
        return any(d.finished for d in self.deltas.get(rid, ()))


def _wait(predicate, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_killed_rank_fails_requests_then_recovers(ray_cluster, tiny_model, reference):
    import ray

    from raymoe.actors.driver_service import AddRequest, DriverService

    with Engine(tiny_model, tp_size=1, dp_size=2, ep_size=2) as e:
        out = _Collector()
        service = DriverService(e.driver, publish=out)
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        service.submit([AddRequest(f"r{i}", e.encode(PROMPTS[i]), long) for i in range(4)])
        _wait(lambda: service.driver.num_steps >= 5, 60)
        # Batched publishing: one message per step carries every request's tokens.
        assert out.num_batches <= service.driver.num_steps + 1
        ray.kill(e.driver.executor.workers[1])
        # The streams end (a generous bound on progress, not on speed) with an error ...
        _wait(lambda: all(out.finished(f"r{i}") for i in range(4)), 120)
        last = [out.deltas[f"r{i}"][-1] for i in range(4)]
        assert all(d.error is not None and d.error.kind == "unhealthy" for d in last), last
        # ... and the tokens each got before the fault are its own: the undisturbed run's (as far as both go).
        for i in range(4):
            got, want = [t for d in out.deltas[f"r{i}"] for t in d.token_ids], reference[PROMPTS[i]]
            n = min(len(got), len(want))
            assert n > 0 and got[:n] == want[:n], (i, got[:n], want[:n])
        assert isinstance(last[0].error.to_exception(), EngineUnhealthyError)
        _wait(service.healthy, 180)
        assert service.num_recoveries == 1

        service.submit([AddRequest("after", e.encode(PROMPTS[0]), GREEDY)])
        _wait(lambda: out.finished("after"), 60)
        assert [t for d in out.deltas["after"] for t in d.token_ids] == reference[PROMPTS[0]]
        service.shutdown()


@pytest.mark.parametrize("overlap", [{"enable_tbo": True, "tbo_min_tokens_decode": 2, "tbo_min_tokens_extend": 4},
                                     {"enable_sbo": True}])
def test_overlap_engine_matches_single_rank(ray_cluster, tiny_model, reference, overlap):
    """TBO (decode and extend steps, with graphs) and SBO on ep=2, dp=2 give the single-rank greedy tokens."""
    with Engine(tiny_model, tp_size=1, dp_size=2, ep_size=2, **overlap) as e:
        outs = e.generate(PROMPTS, GREEDY)
        staggered = run_staggered(e, PROMPTS)
        tbo_steps, graph_steps = e.driver.num_tbo_steps, e.driver.num_graph_steps
    assert [o.token_ids for o in outs] == [reference[p] for p in PROMPTS]
    assert staggered == reference
    if overlap.get("enable_tbo"):
        assert tbo_steps > 0 and graph_steps > 0


def test_group_scheduler_processes_serve_the_single_rank_tokens_and_survive_faults(ray_cluster, tiny_model,
                                                                                     reference):
    """``group_schedulers="actors"`` on dp=2 ep=2, served through the front end's client: one scheduler process per
    DP group beside its rank sends the rank its batches and the front end its rows. Streams match a single rank; an
    abort frees its KV; a step the ranks raise in fails only that step's requests; a killed group process is a
    rank fault (ranks and groups restart, its requests are resumed by the front end and complete) and the engine
    serves again."""
    import asyncio

    import ray
    from idle import assert_idle

    from raymoe.client.engine_client import EngineClient
    from raymoe.config import EngineConfig, ParallelConfig
    from raymoe.errors import RequestFailedError

    config = EngineConfig(model=tiny_model, parallel=ParallelConfig(dp_size=2, ep_size=2), group_schedulers="actors",
                          device="cpu")
    client = EngineClient(config)
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)

    async def fault_midway(rid, prompt, fault) -> Exception | None:
        """Start a long request, apply ``fault`` once it streams, and return the error it ended with."""
        stream = client.generate(rid, client.tokenizer.encode(prompt, add_special_tokens=False), long)
        await stream.__anext__()
        await fault()
        try:
            async for _ in stream:
                pass
        except Exception as e:  # noqa: BLE001 - the test checks its type
            return e
        return None

    async def tokens(rid, prompt, params=GREEDY):
        out = []
        async for d in client.generate(rid, client.tokenizer.encode(prompt, add_special_tokens=False), params):
            out += d.token_ids
        return out

    async def main():
        got = await asyncio.gather(*(tokens(f"p{i}", p) for i, p in enumerate(PROMPTS)))
        assert got == [reference[p] for p in PROMPTS]
        stream = client.generate("cut", client.tokenizer.encode(PROMPTS[0], add_special_tokens=False), long)
        await stream.__anext__()
        await stream.aclose()  # the client went away: the request is aborted in its group

        async def step_error():
            await asyncio.to_thread(ray.get, client.driver.inject_fault.remote("rank_step_error"), timeout=30)

        assert isinstance(await fault_midway("fails", PROMPTS[1], step_error), RequestFailedError)
        assert await tokens("after-step-error", PROMPTS[2]) == reference[PROMPTS[2]]

        async def kill_group():
            groups = await asyncio.to_thread(ray.get, client.driver.group_actors.remote(), timeout=30)
            assert len(groups) == 2
            ray.kill(groups[1], no_restart=True)

        # The ranks and the group processes are rebuilt; the in-flight request is resumed and completes.
        assert await fault_midway("lost", PROMPTS[3], kill_group) is None
        assert client.resumed_requests >= 1
        for _ in range(600):
            if await client.healthy():
                break
            await asyncio.sleep(0.5)
        assert await tokens("after-restart", PROMPTS[4]) == reference[PROMPTS[4]]
        stats = await client.stats()
        assert stats.rank_restarts == 1 and stats.failed_steps >= 1

    try:
        asyncio.run(main())
        assert len(ray.get(client.driver.pids.remote(), timeout=30)) == 1 + 2 + 2  # driver, ranks, groups
        assert_idle(client)
    finally:
        client.shutdown()
