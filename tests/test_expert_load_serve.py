"""Expert load scraped from a running ``raymoe serve`` (its own process and Ray, dp=2 ep=2, tiny Qwen3-MoE of 4 MoE
layers, 8 experts, top-2, ``--enable-eplb``): ``/metrics`` carries one ``raymoe:expert_load`` series per (layer,
expert) whose sum per layer is exactly the routed (token, expert) pairs of the requests served (the counters are
collected every step, ``--eplb-record-interval 1``), equal to ``GET /admin/expert_load``; the per-layer balance is
mean / max of the two ranks' load; every series the dashboard reads has samples; ``raymoe eplb dump`` writes a file
``init_expert_location`` accepts; ``POST /admin/rebalance_experts`` reaches the driver, which plans a rebalance; a
repeated prompt is routed to the DP group that cached it, and the routing counters say so."""

from __future__ import annotations

import httpx
from serve_process import serve_process
from server_harness import dashboard_metrics, exported_names, metrics, wait_for

KEY = "eplb-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LAYERS, EXPERTS, TOP_K, EP = 4, 8, 2, 2  # the tiny_model fixture (conftest), over 2 EP ranks


def _complete(url: str, prompt: str) -> int:
    """One greedy completion of 6 tokens; returns the tokens it forwarded through the model (the prompt less its
    cached prefix, and every output token but the last)."""
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["prompt_tokens"] - cached + usage["completion_tokens"] - 1


def _admin_load(url: str) -> dict:
    r = httpx.get(f"{url}/admin/expert_load", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_expert_load_metrics_admin_route_and_dump_of_a_running_serve(tiny_model, tmp_path, capsys):
    from raymoe.cli import main
    from raymoe.eplb.initial import initial_expert_location

    flags = ("--dp", "2", "--ep", "2", "--enable-eplb", "--eplb-record-interval", "1", "--eplb-min-window-tokens",
             "1", "--api-key", KEY)
    with serve_process(tiny_model, *flags) as server:
        url = server.url
        assert httpx.get(f"{url}/admin/expert_load", timeout=30).status_code == 401  # the API key, as on /v1
        long = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3
        prompts = ("def fib(n):", "import os\nimport sys", "class A:", long, long)
        forwarded = sum(_complete(url, p) for p in prompts)
        pairs = forwarded * TOP_K
        # The last step's counters reach the driver with that step's answer: wait until they are in.
        wait_for(lambda: all(sum(row) == pairs for row in _admin_load(url)["expert_load"]), timeout_s=30)
        record = _admin_load(url)
        assert record["num_logical_experts"] == EXPERTS and record["ep_size"] == EP and record["window_steps"] > 0
        assert len(record["expert_load"]) == LAYERS

        m = metrics(url)
        load = [[m[f"raymoe:expert_load{{expert={e},layer={layer}}}"] for e in range(EXPERTS)]
                for layer in range(LAYERS)]
        assert load == record["expert_load"]
        assert [sum(row) for row in load] == [pairs] * LAYERS
        for layer, row in enumerate(load):  # ranks hold experts 0-3 and 4-7 (no placement file, no rebalance yet)
            ranks = [sum(row[:4]), sum(row[4:])]
            expected = sum(ranks) / EP / max(ranks)
            assert abs(m[f"raymoe:expert_balance{{layer={layer}}}"] - expected) < 1e-9
            assert abs(record["balance"][layer] - expected) < 1e-9
        assert m["raymoe:eplb_rebalances_total"] == 0 and m["raymoe:eplb_moving"] == 0
        # DP routing: the repeated long prompt went to the group that cached it (raymoe.actors.dp_router).
        routed = {r: m[f"raymoe:dp_routed_requests_total{{reason={r}}}"] for r in ("prefix", "load")}
        assert routed["prefix"] >= 1 and sum(routed.values()) == len(prompts), routed
        assert m["raymoe:dp_route_expected_cached_tokens_total"] >= 16
        samples, _ = exported_names(httpx.get(f"{url}/metrics", timeout=30).text)
        assert dashboard_metrics() <= samples, dashboard_metrics() - samples

        out = tmp_path / "load.json"
        assert main(["eplb", "dump", "--out", str(out), "--url", url, "--api-key", KEY]) == 0
        assert "4 MoE layers x 8 experts" in capsys.readouterr().out
        location = initial_expert_location(LAYERS, EXPERTS, EP, 2, str(out))  # 2 redundant slots: 10 in all
        assert location.num_physical == EXPERTS + 2
        assert all(set(row) == set(range(EXPERTS)) for row in location.physical_to_logical)

        r = httpx.post(f"{url}/admin/rebalance_experts", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json() == {"requested": True}
        pairs += _complete(url, "for i in range(3):") * TOP_K
        wait_for(lambda: metrics(url)["raymoe:eplb_rebalances_total"] >= 1, timeout_s=30)
        wait_for(lambda: all(sum(row) == pairs for row in _admin_load(url)["expert_load"]), timeout_s=30)
