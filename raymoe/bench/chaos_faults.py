"""The fault harness behind ``raymoe bench chaos`` and its CI-sized test: faults injected while streams run, and
the invariants checked after each.

A :class:`ChaosHarness` drives a served engine (an ``EngineClient`` behind the OpenAI app) over HTTP. For each fault
it starts ``streams`` greedy streaming completions (``ignore_eos``, ``max_tokens`` each), injects the fault once
every stream has its first token, waits for every stream to end, and checks:

* every request completed (``finish_reason`` and ``data: [DONE]``) or ended with a clear error (which one is kept);
* no stream waited longer than ``stream_timeout_s`` (no hang), and the longest pause between two chunks of a stream;
* the idle invariant once the engine is idle again (no KV slot, request row or radix lock leaked);
* every completed stream's text equals its undisturbed run's (taken before the first fault, same engine);
* how the engine recovered: shrunk onto the surviving DP groups (elastic EP, ``raymoe.actors.elastic_world``; the
  harness then waits until the group has grown back, so the next fault meets the full layout), the rank group
  rebuilt, or a new driver; and how many rank processes from before the fault still serve afterwards.

Faults (``FAULTS``): ``sigkill_rank`` (SIGKILL of a rank process), ``sigstop_rank`` (SIGSTOP of a rank for longer
than the engine's step bound: the driver's watchdog must turn it into a rank fault), ``slow_rank`` (an injected
delay per step on one rank, below the bound: slowness is not a fault), ``kill_driver`` (the driver actor's process;
Ray restarts it) and ``remove_node`` (the node of a rank leaves the multi-raylet cluster; needs the cluster; once
the streams ended a fresh node joins, through ``add_node``, so capacity returns for the next fault).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

FAULTS = ("sigkill_rank", "sigstop_rank", "slow_rank", "kill_driver", "remove_node")


@dataclass
class StreamOutcome:
    """How one stream ended: its text, ``finish_reason`` or ``error``, whether ``[DONE]`` came, its chunk gaps
    (seconds)."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    completion_tokens: int = 0
    gaps: list[float] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason is not None and self.done


@dataclass(frozen=True)
class ChaosResult:
    """One fault's row of the table.

    Attributes:
        fault: one of ``FAULTS``. requests: streams run. running_at_fault: streams not yet ended once the fault was
        injected (a fault that lands after them tests nothing). failed: streams that did not complete; errors: their
        distinct error messages. resumed: requests the front end resumed after the fault. tokens_checked: tokens of
        completed streams compared with the undisturbed run; mismatched: completed streams whose text differs.
        longest_pause_s: the longest gap between two chunks of any stream, seconds. detected_s / recovered_s: from
        the fault to ``/health`` going unhealthy / healthy again, seconds (None: it never went unhealthy).
        idle_ok: the idle invariant held afterwards (``idle_detail`` says what leaked otherwise).
        recovery: ``"shrink"`` (then grown back), ``"restart"`` (rank group rebuilt), ``"new driver"`` or ``"-"``
        (no fault seen). ranks_kept: rank processes from before the fault that serve afterwards. regrown_s: from
        the fault to the group's return to its full layout after a shrink, seconds (None: no shrink).
        steps_shrunk: engine steps run on the survivors before the group grew back.
    """

    fault: str
    requests: int
    running_at_fault: int
    failed: int
    errors: tuple[str, ...]
    resumed: int
    tokens_checked: int
    mismatched: int
    longest_pause_s: float
    detected_s: float | None
    recovered_s: float | None
    idle_ok: bool
    idle_detail: str = ""
    recovery: str = "-"
    ranks_kept: int = 0
    regrown_s: float | None = None
    steps_shrunk: int = 0

    @property
    def ok(self) -> bool:
        """No request failed or got other tokens, and nothing leaked."""
        return self.failed == 0 and self.mismatched == 0 and self.idle_ok


class ChaosHarness:
    """Faults against one served engine (module docstring).

    Args:
        engine: the ``EngineClient`` (its driver actor's rank handles and counters are read).
        base_url: the OpenAI app serving it.
        streams: concurrent streams per fault. max_tokens: tokens per stream.
        stream_timeout_s: bound on one fault's streams, seconds (beyond it the run counts as a hang and raises).
        cluster: the ``ray.cluster_utils.Cluster`` (``remove_node`` only). add_node: adds a fresh worker node to
            it (called after a ``remove_node`` fault's streams; None: none joins).
        slow_delay_s / slow_steps: the ``slow_rank`` delay per step, seconds, and for how many steps.
    """

    def __init__(self, engine, base_url: str, *, streams: int = 64, max_tokens: int = 128,
                 stream_timeout_s: float = 300.0, cluster=None, slow_delay_s: float = 0.2, slow_steps: int = 20,
                 add_node=None):
        if streams < 1 or max_tokens < 1:
            raise ValueError("streams and max_tokens must be >= 1")
        self.engine, self.base_url = engine, base_url
        self.notes: list[str] = []  # what the harness had to do beyond the fault (e.g. kill a stopped rank)
        self.streams, self.max_tokens, self.stream_timeout_s = streams, max_tokens, stream_timeout_s
        self.cluster, self.slow_delay_s, self.slow_steps = cluster, slow_delay_s, slow_steps
        self.add_node = add_node
        self.prompts = [f"chaos stream {i}: def f{i}(x):" for i in range(streams)]
        self._reference: list[str] | None = None
        self._after = None  # what a fault waits for once its streams ended (given the fault's time)

    # ------------------------------------------------------------------------------------------------ streams
    async def _stream(self, client, prompt: str, first: asyncio.Event) -> StreamOutcome:
        out = StreamOutcome()
        body = {"model": self.engine.model_name, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:160].decode(errors='replace')}"
                first.set()
                return out
            last = time.monotonic()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    out.done = True
                    continue
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                out.gaps.append(now - last)
                last = now
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = f"{event['error'].get('code')}: {event['error'].get('message')}"
                    continue
                first.set()
                out.completion_tokens = (event.get("usage") or {}).get("completion_tokens", out.completion_tokens)
                for choice in event.get("choices", []):
                    out.text += choice.get("text") or ""
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
        first.set()
        return out

    async def _run(self, inject=None) -> tuple[list[StreamOutcome], list[tuple[float, int]], int]:
        """Run every stream; ``inject()`` (in a thread) once each has a token. Returns the outcomes, the /health
        timeline ``(seconds since the fault, status)`` and how many streams were still running when the fault
        had been injected."""
        import httpx

        limits = httpx.Limits(max_connections=self.streams + 4, max_keepalive_connections=self.streams + 4)
        timeline: list[tuple[float, int]] = []
        injected = [time.monotonic()]
        stop = asyncio.Event()

        async def watch(c):
            while not stop.is_set():
                try:
                    code = (await c.get("/health", timeout=5.0)).status_code
                except httpx.HTTPError:
                    code = 0
                if not timeline or timeline[-1][1] != code:
                    timeline.append((time.monotonic() - injected[0], code))
                await asyncio.sleep(0.05)

        async with httpx.AsyncClient(base_url=self.base_url, limits=limits,
                                     timeout=httpx.Timeout(self.stream_timeout_s)) as client:
            firsts = [asyncio.Event() for _ in self.prompts]
            tasks = [asyncio.create_task(self._stream(client, p, f)) for p, f in zip(self.prompts, firsts,
                                                                                       strict=True)]
            watcher = None
            try:
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), self.stream_timeout_s)
                running = 0
                if inject is not None:
                    injected[0] = time.monotonic()
                    watcher = asyncio.create_task(watch(client))
                    await asyncio.to_thread(inject)
                    running = sum(not t.done() for t in tasks)
                outs = await asyncio.wait_for(asyncio.gather(*tasks), self.stream_timeout_s)
                if watcher is not None:  # health must come back before the row is written
                    deadline = time.monotonic() + self.stream_timeout_s
                    while (not timeline or timeline[-1][1] != 200) and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)
            except TimeoutError:
                raise TimeoutError(f"streams did not end within {self.stream_timeout_s} s: a hang") from None
            finally:
                stop.set()
                if watcher is not None:
                    await watcher
                for t in tasks:
                    t.cancel()
        return outs, timeline, running

    def reference(self) -> list[str]:
        """Each stream's text run undisturbed (greedy: the same in any batch); taken once."""
        if self._reference is None:
            outs, _, _ = asyncio.run(self._run())
            bad = [o for o in outs if not o.completed]
            if bad:
                raise RuntimeError(f"the undisturbed run did not complete: {bad[0]}")
            self._reference = [o.text for o in outs]
        return self._reference

    # ------------------------------------------------------------------------------------------------- faults
    def _rank(self, index: int = -1):
        """The handle and process id of one rank (default: the last, DP group ``dp - 1``'s)."""
        import ray

        ranks = ray.get(self.engine.driver.rank_actors.remote(), timeout=60)
        if not ranks:
            raise RuntimeError("the engine has no rank actors (a one-rank engine computes in the driver)")
        rank = ranks[index]
        return rank, ray.get(rank.pid.remote(), timeout=60)

    def _injector(self, fault: str):
        """The fault as a call that injects it at once: its target (rank, process, node) is looked up now, before
        the streams start, so that the fault lands while they run."""
        import ray

        if fault == "kill_driver":
            driver = self.engine.driver
            return lambda: ray.kill(driver, no_restart=False)
        rank, pid = self._rank()
        if fault == "sigkill_rank":
            return lambda: os.kill(pid, signal.SIGKILL)
        if fault == "sigstop_rank":
            self._after = lambda at: self._wait_stopped_rank_killed(pid, at)
            return lambda: os.kill(pid, signal.SIGSTOP)
        if fault == "slow_rank":
            return lambda: ray.get(rank.inject_step_delay.remote(self.slow_delay_s, self.slow_steps), timeout=60)
        if fault == "remove_node":
            if self.cluster is None:
                raise ValueError("remove_node needs the multi-raylet cluster (ChaosHarness(cluster=...))")
            node_id = ray.get(rank.node_id.remote(), timeout=60)
            node = next(n for n in self.cluster.list_all_nodes() if n.node_id == node_id)
            if node is self.cluster.head_node:
                raise RuntimeError("the rank runs on the head node; remove_node needs it on a worker node")
            if self.add_node is not None:
                self._after = lambda _at: self.add_node()
            return lambda: self.cluster.remove_node(node)
        raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")

    def _wait_stopped_rank_killed(self, pid: int, stopped_at: float) -> None:
        """After the streams of a ``sigstop_rank`` fault: wait until the recovery that the driver's watchdog
        (``step_timeout_s``) started has killed the stopped process ``pid``; if it has not within the bound plus
        30 s from ``stopped_at`` (the start of the fault's run, just before the signal), note that and kill it
        (the table shows whether health ever dropped)."""
        deadline = stopped_at + self.engine.config.step_timeout_s + 30.0
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            self.notes.append(f"sigstop_rank: the stopped rank (pid {pid}) was not killed within step_timeout_s + "
                              "30 s; the harness killed it")
            os.kill(pid, signal.SIGKILL)

    def _counters(self) -> tuple[int, int, int, int]:
        """The driver's (ep_shrinks, ep_grows, rank_restarts, steps_shrunk), retried while the driver is being
        restarted."""
        import ray

        deadline = time.monotonic() + 60.0
        while True:
            try:
                s = ray.get(self.engine.driver.stats.remote(), timeout=10)
                return s.ep_shrinks, s.ep_grows, s.rank_restarts, s.steps_shrunk
            except Exception:  # noqa: BLE001 - the driver is being restarted
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _rank_pids(self) -> set[int]:
        import ray

        ranks = ray.get(self.engine.driver.rank_actors.remote(), timeout=60)
        return set(ray.get([r.pid.remote() for r in ranks], timeout=60))

    def _wait_regrown(self, before: tuple[int, int, int, int], injected_at: float) -> float | None:
        """After a shrink, wait until the group has grown back (bounded by ``stream_timeout_s``); seconds from the
        fault, or None when it did not shrink (a note when it did not grow back in time)."""
        shrinks, grows = before[:2]
        deadline = time.monotonic() + self.stream_timeout_s
        now = self._counters()
        if now[0] <= shrinks:
            return None
        while now[1] - grows < now[0] - shrinks:
            if time.monotonic() > deadline:
                self.notes.append(f"the rank group did not grow back within {self.stream_timeout_s} s")
                return None
            time.sleep(0.2)
            now = self._counters()
        return time.monotonic() - injected_at

    def _idle(self, timeout_s: float = 60.0) -> tuple[bool, str]:
        """Wait until the engine is idle and has measured its idle invariant; whether it holds, and why not."""
        import ray

        deadline = time.monotonic() + timeout_s
        s = None
        while time.monotonic() < deadline:
            try:
                s = ray.get(self.engine.driver.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the driver is being restarted
                time.sleep(0.2)
                continue
            if s.idle_checked and s.num_running == 0 and s.num_waiting == 0:
                leaks = (s.kv_leaked_slots, s.req_rows_leaked, s.cache_tokens_locked)
                return leaks == (0, 0, 0), "" if leaks == (0, 0, 0) else (
                    f"leaked KV slots {leaks[0]}, request rows {leaks[1]}, locked radix tokens {leaks[2]}")
            time.sleep(0.2)
        return False, f"not idle within {timeout_s} s ({s})"

    def run(self, fault: str) -> ChaosResult:
        """Inject ``fault`` while the streams run and check the invariants (module docstring).

        Raises:
            ValueError: an unknown fault, or ``remove_node`` without the cluster.
            TimeoutError: the streams did not end within ``stream_timeout_s`` (a hang).
        """
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
        reference = self.reference()
        resumed = self.engine.resumed_requests
        inject = self._injector(fault)
        before, pids = self._counters(), self._rank_pids()
        injected_at = time.monotonic()
        outs, timeline, running = asyncio.run(self._run(inject))
        if self._after is not None:
            self._after(injected_at)
            self._after = None
        regrown = self._wait_regrown(before, injected_at)
        after = self._counters()
        recovery = ("shrink" if regrown is not None else "restart" if after[2] > before[2]
                    else "new driver" if fault == "kill_driver" else "-")
        down = next((t for t, code in timeline if code != 200), None)
        up = next((t for t, code in timeline if code == 200 and down is not None and t > down), None)
        idle_ok, idle_detail = self._idle()
        done = [(o, ref) for o, ref in zip(outs, reference, strict=True) if o.completed]
        failed = [o for o in outs if not o.completed]
        return ChaosResult(
            fault=fault, requests=len(outs), running_at_fault=running, failed=len(failed),
            errors=tuple(sorted({o.error or "ended without [DONE]" for o in failed})),
            resumed=self.engine.resumed_requests - resumed,
            tokens_checked=sum(o.completion_tokens for o, ref in done if o.text == ref),
            mismatched=sum(o.text != ref or o.completion_tokens != self.max_tokens for o, ref in done),
            longest_pause_s=max((max(o.gaps) for o in outs if o.gaps), default=0.0),
            detected_s=down, recovered_s=up, idle_ok=idle_ok, idle_detail=idle_detail, recovery=recovery,
            ranks_kept=len(pids & self._rank_pids()), regrown_s=regrown,
            steps_shrunk=max(after[3] - before[3], 0))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def format_table(results: list[ChaosResult]) -> str:
    """The harness's table: one row per fault (running: streams still running once the fault was injected; kept:
    rank processes from before the fault that serve afterwards; regrown: seconds from the fault to the full layout
    after a shrink)."""
    head = (f"{'fault':<14} {'requests':>8} {'running':>7} {'failed':>6} {'resumed':>7} {'tokens checked':>14} "
            f"{'mismatched':>10} {'longest pause':>13} {'detected':>8} {'recovered':>9} {'idle':>4} "
            f"{'recovery':>10} {'kept':>4} {'regrown':>7}")
    rows = [head, "-" * len(head)]
    for r in results:
        det = f"{r.detected_s:.1f} s" if r.detected_s is not None else "-"
        rec = f"{r.recovered_s:.1f} s" if r.recovered_s is not None else "-"
        idle = "ok" if r.idle_ok else "LEAK"
        grown = f"{r.regrown_s:.1f} s" if r.regrown_s is not None else "-"
        rows.append(f"{r.fault:<14} {r.requests:>8} {r.running_at_fault:>7} {r.failed:>6} {r.resumed:>7} "
                    f"{r.tokens_checked:>14} {r.mismatched:>10} {r.longest_pause_s:>11.2f} s {det:>8} {rec:>9} "
                    f"{idle:>4} {r.recovery:>10} {r.ranks_kept:>4} {grown:>7}")
        rows.extend(f"    error: {e}" for e in r.errors)
    return "\n".join(rows)
