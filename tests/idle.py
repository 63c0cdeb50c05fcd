"""``assert_idle``: the "nothing lost" check that every stress and fault test ends with.

With no request in flight, every KV slot is free or held by an unlocked (evictable) radix-cache node, every
ReqToTokenPool row is free, and no radix lock is held. Works on a ``Driver`` (checked directly, with the
schedulers' full accounting), a ``DriverService`` or ``EngineClient`` (through ``EngineStats``), or a server URL
(through ``/metrics``; the leak gauge is checked when the server exports it).
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

LEAK_GAUGES = ("raymoe:kv_leaked_slots", "raymoe:req_rows_leaked")


def _stats(target):
    if hasattr(target, "driver") and hasattr(target.driver, "stats"):  # EngineClient: its driver actor
        import ray

        return ray.get(target.driver.stats.remote(), timeout=30)
    return target.stats()  # DriverService


def _check_driver(driver) -> None:
    report = driver.idle_report()
    assert report is not None, "requests are still in flight"
    assert report.clean, (f"idle invariant broken: leaked_kv_slots={report.leaked_kv_slots} "
                          f"leaked_req_rows={report.leaked_req_rows} locked_cache_tokens={report.locked_cache_tokens}")
    for s in driver.schedulers:
        s.check_memory_invariants()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def assert_idle(target, timeout_s: float = 30.0) -> None:
    """Wait (up to ``timeout_s`` seconds) until no request runs or waits, then assert the idle invariant.

    Args:
        target: a ``Driver``, a ``DriverService``, an ``EngineClient`` or a server's base URL.

    Raises:
        AssertionError: requests are still in flight after ``timeout_s``, or a KV slot, row or lock leaked.
    """
    if hasattr(target, "idle_report") and hasattr(target, "schedulers"):
        _check_driver(target)
        return
    deadline = time.monotonic() + timeout_s
    if isinstance(target, str):
        while True:
            m = _metrics(target)
            idle = (m.get("raymoe:num_requests_running") == 0 and m.get("raymoe:num_requests_waiting") == 0
                    and m.get("raymoe:kv_cache_usage_perc") == 0)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert idle, f"engine not idle: { {k: v for k, v in m.items() if 'requests' in k or 'kv' in k} }"
        for name in LEAK_GAUGES:
            assert m.get(name, 0) == 0, f"{name} = {m[name]}"
        return
    while True:
        s = _stats(target)
        if (s.num_running == 0 and s.num_waiting == 0 and s.idle_checked) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert s.num_running == 0 and s.num_waiting == 0 and s.idle_checked, f"engine not idle: {s}"
    assert (s.kv_leaked_slots, s.req_rows_leaked, s.cache_tokens_locked) == (0, 0, 0), (
        f"idle invariant broken: leaked_kv_slots={s.kv_leaked_slots} req_rows_leaked={s.req_rows_leaked} "
        f"cache_tokens_locked={s.cache_tokens_locked}")
