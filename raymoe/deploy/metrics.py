"""Prometheus metrics of the server (``raymoe:`` prefix, ``model_name`` label), with prometheus-client.

Two sources:
- per-request figures observed by the front end (:class:`RequestMetrics`): time to first token, inter-token
  latency, end-to-end latency, prompt/generation tokens, finished requests by finish reason, error answers;
- engine state (:class:`EngineStats`), fetched when ``/metrics`` is scraped and exposed by a custom collector:
  running/waiting requests, KV cache usage, engine steps, two-batch-overlap steps, radix cache hit tokens,
  per-rank step time, and histograms of the step period and the ranks' forward time by kind of step
  (``raymoe.actors.step_timing``); with expert load recorded (``enable_expert_distribution_metrics`` or
  ``enable_eplb``) the load window of every (MoE layer, logical expert), each layer's balance and the rebalance
  counters (``raymoe.eplb.report.ExpertLoadReport``); with speculative decoding the verify steps, draft and
  accepted tokens, the acceptance rate and a histogram of accepted drafts per request and step.

Each :class:`ServerMetrics` has its own registry, so several apps (tests, Serve replicas) never collide.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from raymoe.actors.dp_router import RouteCounters
from raymoe.actors.driver_service import EngineStats
from raymoe.actors.step_timing import StepTimes
from raymoe.eplb.report import ExpertLoadReport
from raymoe.scheduler.spec_steps import SpecCounters

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineStatsCollector:
    """Exposes the latest :class:`EngineStats` snapshot (set by :meth:`ServerMetrics.render`)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self):
        """The engine metric families of the latest snapshot (families without samples when unknown)."""
        s, m = self.stats, [self.model_name]

        def gauge(name: str, doc: str, value: float | None):
            fam = GaugeMetricFamily(f"raymoe:{name}", doc, labels=["model_name"])
            if value is not None:
                fam.add_metric(m, float(value))
            return fam

        def counter(name: str, doc: str, value: float | None):
            fam = CounterMetricFamily(f"raymoe:{name}", doc, labels=["model_name"])
            if value is not None:
                fam.add_metric(m, float(value))
            return fam

        yield gauge("num_requests_running", "Requests holding KV (decoding or prefilling).", s and s.num_running)
        yield gauge("num_requests_waiting", "Requests queued in the schedulers.", s and s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV slots in use (max over DP groups; cached free "
                                           "prefixes count as free), 0..1.", s and s.kv_usage)
        yield gauge("engine_healthy", "1 when every rank is up, else 0.", 0.0 if s is None else float(s.healthy))
        yield counter("engine_steps", "Global engine steps run.", s and s.num_steps)
        yield counter("tbo_steps", "Engine steps that ran two-batch overlap.", s and s.num_tbo_steps)
        yield counter("radix_cache_hit_tokens", "Prompt tokens served from the radix (prefix) cache.",
                      s and s.radix_hit_tokens)
        idle = s is not None and s.idle_checked  # the idle invariant is known once measured with nothing in flight
        yield gauge("kv_leaked_slots", "KV slots not free the last time no request was in flight (0 when the idle "
                                       "invariant holds).", s.kv_leaked_slots if idle else None)
        yield gauge("req_rows_leaked", "ReqToTokenPool rows not free the last time no request was in flight.",
                    s.req_rows_leaked if idle else None)
        yield gauge("cache_tokens_locked_idle", "Radix-cache tokens still locked the last time no request was in "
                                                "flight.", s.cache_tokens_locked if idle else None)
        yield counter("rank_restarts", "Rank-group restarts after rank faults (never for a bad request).",
                      s and s.rank_restarts)
        yield counter("ep_shrinks", "Rank faults answered by shrinking onto the surviving DP groups (elastic EP).",
                      s and s.ep_shrinks)
        yield counter("ep_grows", "Returns to the full rank layout after a shrink, once replacement ranks started.",
                      s and s.ep_grows)
        yield counter("steps_shrunk", "Engine steps run while the rank group was shrunk onto its survivors.",
                      s and s.steps_shrunk)
        yield gauge("dp_groups_serving", "DP groups serving now (fewer than configured while shrunk).",
                    s and s.dp_size)
        yield counter("driver_loop_restarts", "Times the supervisor restarted a dead driver loop.",
                      s and s.loop_restarts)
        yield counter("failed_requests", "Requests that failed alone inside the engine (others kept running).",
                      s and s.failed_requests)
        yield counter("weight_updates", "Weight updates applied (from disk or from tensors).",
                      s and s.weight_updates)
        version = GaugeMetricFamily("raymoe:weight_version_info", "1 for the name of the weights serving "
                                    "(label weight_version; \"default\" until an update names one).",
                                    labels=["model_name", "weight_version"])
        if s is not None:
            version.add_metric([self.model_name, s.weight_version], 1.0)
        yield version
        step = GaugeMetricFamily("raymoe:step_duration_seconds",
                                 "Forward + sampling time of the last step on each DP group's tp-rank 0 "
                                 "(label rank = DP group index).", labels=["model_name", "rank"])
        for rank, seconds in enumerate(s.step_seconds if s else ()):
            step.add_metric([self.model_name, str(rank)], float(seconds))
        yield step
        yield from self._step_histograms(s.step_times if s else None)
        yield from self._expert_load(s.expert_load if s else None)
        yield from self._routing(s.routing if s else None)
        yield from self._speculative(s.spec if s else None)

    def _speculative(self, c: SpecCounters | None):
        """Speculative decoding (``speculative_algorithm``): declared always, with samples only when it is on."""
        m = [self.model_name]
        steps = CounterMetricFamily("raymoe:spec_verify_steps", "Speculative verify steps (TARGET_VERIFY) run by the "
                                    "DP groups.", labels=["model_name"])
        drafts = CounterMetricFamily("raymoe:spec_draft_tokens", "Draft tokens the target model verified.",
                                     labels=["model_name"])
        accepted = CounterMetricFamily("raymoe:spec_accepted_tokens", "Draft tokens the target model accepted.",
                                       labels=["model_name"])
        rate = GaugeMetricFamily("raymoe:spec_acceptance_rate", "Accepted / verified draft tokens so far, 0..1.",
                                 labels=["model_name"])
        length = HistogramMetricFamily(
            "raymoe:spec_accept_length", "Draft tokens accepted per request and verify step (each step also adds "
                                         "one token of the target's own).", labels=["model_name"])
        if c is not None:
            steps.add_metric(m, float(c.verify_steps))
            drafts.add_metric(m, float(c.draft_tokens))
            accepted.add_metric(m, float(c.accepted_tokens))
            rate.add_metric(m, c.acceptance_rate)
            running, buckets = 0, []
            for j, n in enumerate(c.accept_len_counts):
                running += n
                buckets.append((str(float(j)) if j < len(c.accept_len_counts) - 1 else "+Inf", float(running)))
            if not buckets or buckets[-1][0] != "+Inf":
                buckets.append(("+Inf", float(running)))
            length.add_metric(m, buckets, float(c.accepted_tokens))
        yield from (steps, drafts, accepted, rate, length)

    def _routing(self, c: RouteCounters | None):
        """How new requests were routed to DP groups (``raymoe.actors.dp_router``)."""
        m = self.model_name
        routed = CounterMetricFamily("raymoe:dp_routed_requests",
                                     "New requests routed to a DP group, by reason: prefix (the group held part of "
                                     "the prompt in its radix cache) or load (least loaded group).",
                                     labels=["model_name", "reason"])
        capped = CounterMetricFamily("raymoe:dp_route_load_capped_requests",
                                     "Requests whose longest cached prefix lay on a DP group over the load bound "
                                     "(prefix_routing_max_load_ratio), routed elsewhere.", labels=["model_name"])
        expected = CounterMetricFamily("raymoe:dp_route_expected_cached_tokens",
                                       "Prompt tokens the chosen DP groups held in their radix caches when the "
                                       "requests were routed (compare raymoe:radix_cache_hit_tokens).",
                                       labels=["model_name"])
        if c is not None:
            routed.add_metric([m, "prefix"], float(c.by_prefix))
            routed.add_metric([m, "load"], float(c.by_load))
            capped.add_metric([m], float(c.capped))
            expected.add_metric([m], float(c.expected_cached_tokens))
        yield routed
        yield capped
        yield expected

    def _step_histograms(self, times: StepTimes | None):
        period = HistogramMetricFamily(
            "raymoe:engine_step_period_seconds",
            "Wall time each engine step held the ranks, as the driver sees it (with overlap scheduling the time "
            "between consecutive step results while work lasts; idle time excluded), by mode "
            "(decode / mixed / extend / verify: speculative verify steps).", labels=["model_name", "mode"])
        forward = HistogramMetricFamily(
            "raymoe:engine_step_forward_seconds",
            "Forward + sampling time of each engine step measured on the ranks (the slowest DP group), by mode.",
            labels=["model_name", "mode"])
        for family, hists in ((period, times and times.period), (forward, times and times.forward)):
            for mode, hist in (hists or {}).items():
                family.add_metric([self.model_name, mode], hist.cumulative(), hist.total)
            yield family

    def _expert_load(self, report: ExpertLoadReport | None):
        """The expert-load families: declared always, with samples only when the engine records expert load
        (one ``expert_load`` series per (layer, expert): the rows of a Grafana heatmap)."""
        m = self.model_name
        load = GaugeMetricFamily(
            "raymoe:expert_load",
            "Routed (token, expert) pairs per MoE layer (label layer: the MoE layer's ordinal) and logical expert over "
            "the load window (raymoe:eplb_window_steps steps); a layer's sum is its routed tokens times top_k.",
            labels=["model_name", "layer", "expert"])
        balance = GaugeMetricFamily(
            "raymoe:expert_balance",
            "Per MoE layer, mean / max of the EP ranks' load over the window under the placement the ranks hold "
            "(1.0 = even; the slowest rank sets every step's time).", labels=["model_name", "layer"])
        window = GaugeMetricFamily("raymoe:eplb_window_steps", "Engine steps the expert-load window covers.",
                                   labels=["model_name"])
        rebalances = CounterMetricFamily("raymoe:eplb_rebalances", "Expert rebalances planned (enable_eplb).",
                                         labels=["model_name"])
        commits = CounterMetricFamily("raymoe:eplb_layer_commits",
                                      "MoE layers switched to a new expert placement at a step boundary.",
                                      labels=["model_name"])
        moving = GaugeMetricFamily("raymoe:eplb_moving",
                                   "1 while a rebalance still moves expert weights between ranks, else 0.",
                                   labels=["model_name"])
        if report is not None:
            for layer, row in enumerate(report.expert_load):
                for expert, pairs in enumerate(row):
                    load.add_metric([m, str(layer), str(expert)], float(pairs))
            for layer, value in enumerate(report.balance):
                balance.add_metric([m, str(layer)], float(value))
            window.add_metric([m], float(report.window_steps))
            rebalances.add_metric([m], float(report.num_rebalances))
            commits.add_metric([m], float(report.num_layer_commits))
            moving.add_metric([m], float(report.moving))
        yield from (load, balance, window, rebalances, commits, moving)


class RequestMetrics:
    """Timing of one request; call :meth:`tokens` per delta and :meth:`finish` once."""

    def __init__(self, parent: ServerMetrics):
        self.parent = parent
        self.start = time.perf_counter()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        """``n`` new tokens arrived now."""
        if n <= 0:
            return
        now = time.perf_counter()
        p = self.parent
        if self.last is None:
            p.ttft.observe(now - self.start)
            n -= 1
        if n > 0:
            gap = (now - (self.last if self.last is not None else now)) / n
            for _ in range(n):
                p.itl.observe(gap)
        self.last = now

    def finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count the finished request (``finish_reason``: stop, length or abort)."""
        p = self.parent
        p.e2e.observe(time.perf_counter() - self.start)
        p.prompt_tokens.inc(prompt_tokens)
        p.generation_tokens.inc(completion_tokens)
        p.request_success.labels(p.model_name, finish_reason).inc()


class ServerMetrics:
    """The server's metrics registry.

    Args:
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label, r = ["model_name"], self.registry
        self.ttft = Histogram("raymoe:time_to_first_token_seconds", "Time from request arrival to its first token.",
                              label, buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("raymoe:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             label, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("raymoe:e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             label, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("raymoe:prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("raymoe:generation_tokens", "Generated tokens of finished requests.",
                                         label, registry=r).labels(model_name)
        self.request_success = Counter("raymoe:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finish_reason"], registry=r)
        self.request_errors = Counter("raymoe:request_errors", "Requests answered with an error, by status.",
                                      ["model_name", "status"], registry=r)
        self.in_flight = Gauge("raymoe:num_requests_in_flight",
                               "Requests the HTTP front end is serving (each choice of n counts).", label,
                               registry=r).labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self._engine = _EngineStatsCollector(model_name)
        r.register(self._engine)

    def request(self) -> RequestMetrics:
        """Start timing a request (now)."""
        return RequestMetrics(self)

    def error(self, status: int) -> None:
        """Count a request answered with HTTP ``status``."""
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self, stats: EngineStats | None) -> bytes:
        """The text exposition, with the engine gauges taken from ``stats`` (``None``: engine unreachable)."""
        self._engine.stats = stats
        return generate_latest(self.registry)
