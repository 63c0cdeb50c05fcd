"""The expert-load front end without a model: the ``/metrics`` families of an ``ExpertLoadReport``, the ``/admin``
routes (API key, 404 / 400 naming the option, 503) over a fake engine behind the real FastAPI app, and
``raymoe eplb dump`` against it (its file accepted by ``init_expert_location``; exit 2 with a message when the
server cannot be reached or records nothing)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import anyio
import httpx
import pytest
from fake_engine import FakeEngine
from prometheus_client.parser import text_string_to_metric_families
from server_harness import uvicorn_server

from raymoe.actors.driver_service import EngineStats
from raymoe.eplb.report import ExpertLoadReport
from raymoe.errors import EngineUnhealthyError, InvalidRequestError

KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# 2 MoE layers of 4 experts over 2 ranks (slots 0-1 on rank 0, 2-3 on rank 1): layer 0 routes 12 pairs, rank 0
# takes 9 of them (balance 6 / 9), layer 1 is even.
REPORT = ExpertLoadReport(num_logical=4, ep_size=2, window_steps=48, expert_load=[[6, 3, 2, 1], [2, 2, 2, 2]],
                          balance=[6 / 9, 1.0], physical_to_logical=[[0, 1, 2, 3], [0, 1, 2, 3]], num_rebalances=3,
                          num_layer_commits=5, moving=True)


def _stats(report: ExpertLoadReport | None) -> EngineStats:
    return EngineStats(0, 0, 0.0, 0, 0, 0, True, expert_load=report)


def _samples(text: str) -> dict[str, list]:
    """``{family name: [(labels without model_name, value), ...]}`` of an exposition."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [({k: v for k, v in s.labels.items() if k != "model_name"}, s.value) for s in fam.samples]
    return out


def test_metrics_render_the_load_window_per_layer_and_expert():
    from raymoe.deploy.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    fams = _samples(m.render(_stats(REPORT)).decode())
    load = {(lab["layer"], lab["expert"]): v for lab, v in fams["raymoe:expert_load"]}
    assert load == {(str(L), str(e)): float(REPORT.expert_load[L][e]) for L in range(2) for e in range(4)}
    for layer, row in enumerate(REPORT.expert_load):  # a layer's series sum to its routed pairs
        assert sum(v for (L, _), v in load.items() if L == str(layer)) == sum(row)
    balance = {lab["layer"]: v for lab, v in fams["raymoe:expert_balance"]}
    assert balance == {"0": pytest.approx(6 / 9), "1": 1.0}
    assert fams["raymoe:eplb_window_steps"] == [({}, 48.0)]
    assert [s for s in fams["raymoe:eplb_rebalances"] if s[0] == {}] == [({}, 3.0)]
    assert ({}, 5.0) in fams["raymoe:eplb_layer_commits"]
    assert fams["raymoe:eplb_moving"] == [({}, 1.0)]
    text = m.render(_stats(REPORT)).decode()
    assert "raymoe:eplb_rebalances_total{model_name=\"tiny\"} 3.0" in text  # a counter, _total in the exposition

    idle = ExpertLoadReport(4, 2, 0, [[0] * 4] * 2, [1.0, 1.0], [[0, 1, 2, 3]] * 2)
    assert _samples(m.render(_stats(idle)).decode())["raymoe:eplb_moving"] == [({}, 0.0)]


@pytest.mark.parametrize("stats", [_stats(None), None], ids=["not-recorded", "engine-unreachable"])
def test_metrics_without_expert_load_declare_the_families_without_samples(stats):
    from raymoe.deploy.metrics import ServerMetrics

    text = ServerMetrics("tiny").render(stats).decode()
    fams = _samples(text)
    for name in ("raymoe:expert_load", "raymoe:expert_balance", "raymoe:eplb_window_steps", "raymoe:eplb_moving"):
        assert f"# TYPE {name} gauge" in text and fams[name] == [], name
    for name in ("raymoe:eplb_rebalances", "raymoe:eplb_layer_commits"):
        assert f"# TYPE {name}_total counter" in text and f"{name}_total{{" not in text, name


class _EplbEngine(FakeEngine):
    """The fake engine with an expert-load report (None: not recorded), a rebalance switch and a failure mode."""

    def __init__(self, tokenizer, report: ExpertLoadReport | None, eplb: bool):
        super().__init__(tokenizer)
        self.report = report
        self.eplb = eplb
        self.rebalances = 0
        self.unhealthy = False

    async def stats(self) -> EngineStats:
        if self.unhealthy:
            raise EngineUnhealthyError("the engine's driver went away")
        return _stats(self.report)

    async def rebalance_experts(self) -> bool:
        if self.unhealthy:
            raise EngineUnhealthyError("the engine's driver went away")
        self.rebalances += self.eplb
        return self.eplb


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from raymoe.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


def _app(engine, api_key: str | None = KEY):
    from raymoe.deploy.openai_api import build_openai_app

    return build_openai_app(engine, api_key=api_key)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test", timeout=30)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["request_id"] == r.headers["x-request-id"]
    return err


def test_admin_routes_need_the_api_key_as_v1_does(tokenizer):
    engine = _EplbEngine(tokenizer, REPORT, eplb=True)

    async def main():
        async with _client(_app(engine)) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                v1 = await c.get("/v1/models", headers=headers)
                for r in (await c.get("/admin/expert_load", headers=headers),
                          await c.post("/admin/rebalance_experts", headers=headers)):
                    err, ref = _error(r, 401), _error(v1, 401)
                    assert {k: err[k] for k in ("message", "type", "code")} == \
                           {k: ref[k] for k in ("message", "type", "code")}
                    assert r.headers["www-authenticate"] == "Bearer"
            assert engine.rebalances == 0  # refused before the handler ran
            r = await c.get("/admin/expert_load", headers=AUTH)
            assert r.status_code == 200 and r.json() == REPORT.to_json()
            r = await c.post("/admin/rebalance_experts", headers=AUTH)
            assert r.status_code == 200 and r.json() == {"requested": True} and engine.rebalances == 1
        async with _client(_app(engine, api_key=None)) as c:  # no key set: open, as /v1 is
            assert (await c.get("/admin/expert_load")).json()["expert_load"] == REPORT.expert_load

    anyio.run(main)


def test_the_serve_app_has_the_admin_routes_under_its_api_key(tokenizer, monkeypatch):
    """A Ray Serve replica builds its app with ``build_openai_app`` and its options' key: the same routes."""
    from raymoe.actors import process_tuning
    from raymoe.deploy.serve_app import RaymoeDeployment
    from raymoe.deploy.server_config import ServeOptions

    monkeypatch.setattr(process_tuning, "freeze_startup_heap", lambda: 0)  # not this test process's heap
    # The replica's app builder over a stand-in replica (no engine start, no Serve): its options and a fake engine.
    replica = SimpleNamespace(options=ServeOptions(api_key=KEY), engine=_EplbEngine(tokenizer, REPORT, eplb=True))
    app = RaymoeDeployment.func_or_class.__serve_build_asgi_app__(replica)

    async def main():
        async with _client(app) as c:
            _error(await c.get("/admin/expert_load"), 401)
            assert (await c.get("/admin/expert_load", headers=AUTH)).json() == REPORT.to_json()
            assert (await c.post("/admin/rebalance_experts", headers=AUTH)).json() == {"requested": True}

    anyio.run(main)


def test_admin_routes_name_the_option_that_is_off(tokenizer):
    engine = _EplbEngine(tokenizer, None, eplb=False)

    async def main():
        async with _client(_app(engine)) as c:
            err = _error(await c.get("/admin/expert_load", headers=AUTH), 404)
            assert err["param"] == "enable_expert_distribution_metrics" and err["type"] == "not_found_error"
            assert "enable_expert_distribution_metrics" in err["message"]
            err = _error(await c.post("/admin/rebalance_experts", headers=AUTH), 400)
            assert err["param"] == "enable_eplb" and "enable_eplb" in err["message"]
            engine.unhealthy = True
            for r in (await c.get("/admin/expert_load", headers=AUTH),
                      await c.post("/admin/rebalance_experts", headers=AUTH)):
                assert _error(r, 503)["code"] == "engine_unhealthy"

    anyio.run(main)


def test_eplb_dump_writes_a_file_init_expert_location_accepts(tokenizer, tmp_path, capsys):
    from raymoe.cli import main
    from raymoe.eplb.initial import initial_expert_location

    out = tmp_path / "load.json"
    with uvicorn_server(_app(_EplbEngine(tokenizer, REPORT, eplb=False))) as url:
        assert main(["eplb", "dump", "--out", str(out), "--url", url]) == 2  # no key
        assert "401" in capsys.readouterr().err and not out.exists()
        assert main(["eplb", "dump", "--out", str(out), "--url", url, "--api-key", KEY]) == 0
    assert json.loads(out.read_text()) == REPORT.to_json()
    location = initial_expert_location(2, 4, 2, 0, str(out))
    assert location.num_layers == 2 and location.num_physical == 4
    # Layer 0's hot expert 0 (6 of 12 pairs) shares no rank with the next-hottest, 1 (3 pairs).
    row = location.physical_to_logical[0]
    assert sorted(row) == [0, 1, 2, 3] and row.index(0) // 2 != row.index(1) // 2
    # With 2 redundant slots the hottest expert gets a replica.
    assert initial_expert_location(2, 4, 2, 2, str(out)).physical_to_logical[0].count(0) == 2
    with pytest.raises(InvalidRequestError, match="init_expert_location"):  # checked against the engine's layers
        initial_expert_location(3, 4, 2, 0, str(out))


def test_eplb_dump_fails_clearly(tokenizer, tmp_path, capsys):
    from raymoe.cli import main
    from raymoe.cluster.bootstrap import free_port

    out = tmp_path / "load.json"
    assert main(["eplb", "dump", "--out", str(out), "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    with uvicorn_server(_app(_EplbEngine(tokenizer, None, eplb=False), api_key=None)) as url:
        assert main(["eplb", "dump", "--out", str(out), "--url", url]) == 2
    err = capsys.readouterr().err
    assert "404" in err and "enable_expert_distribution_metrics" in err and not out.exists()
