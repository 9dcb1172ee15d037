"""Prometheus metrics served on the gateway's `/metrics`.

Two sources:
  * request metrics, observed by this gateway replica as tokens stream (histograms and
    counters in the replica's own registry, labelled with `replica`);
  * worker state, read from every worker's `stats()` at scrape time (queues, KV usage,
    transfer counters), so it is current and counted once however many gateways exist.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily

from cluster.engine.step_times import BUCKETS_S, KINDS, Histograms
from cluster.serving.tracing import PHASES

disable_created_metrics()  # no *_created series: they double the output and no dashboard reads them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class GatewayMetrics:
    def __init__(self, replica: str):
        self.replica = replica
        self.phases = Histograms(PHASES["gateway"])  # this replica's requests' admission, tokenize, route
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["replica"]
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Request arrival to its first token, as the gateway saw it.",
            labels, registry=self.registry, buckets=LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Time between successive streamed outputs of one request.",
            labels, registry=self.registry, buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Request arrival to its last token.",
            labels, registry=self.registry, buckets=LATENCY_BUCKETS,
        )
        self.requests = Counter(
            "pdserve_requests", "Finished requests (one per choice) by outcome.",
            ["replica", "status", "finish_reason"], registry=self.registry,
        )
        self.gateway_running = Gauge(
            "pdserve_gateway_requests_running", "Requests holding an admission slot in this gateway replica.",
            labels, registry=self.registry,
        )
        self.gateway_queued = Gauge(
            "pdserve_gateway_requests_queued", "Requests waiting for an admission slot in this gateway replica.",
            labels, registry=self.registry,
        )
        self.rejected = Counter(
            "pdserve_requests_rejected", "Requests refused before any work, by HTTP status.",
            ["replica", "status"], registry=self.registry,
        )
        self.route_fallbacks = Counter(
            "pdserve_route_fallbacks", "kv_aware placements that fell back to prefix_hash, by reason.",
            ["reason"], registry=self.registry,
        )
        self.local_prefills = Counter(
            "pdserve_route_local_prefills", "Prompts placed on their decode worker to compute (the prefill tier's queue was longer).",
            registry=self.registry,
        )
        self.load_overrides = Counter(
            "pdserve_route_load_overrides", "Placements where load beat affinity: the least-loaded worker got the request.",
            ["tier"], registry=self.registry,
        )
        self.migrations = Counter(
            "pdserve_request_migrations", "Requests re-issued to other workers after a worker fault mid-stream, by reason.",
            ["reason"], registry=self.registry,
        )
        self.index_lookup = Histogram(
            "pdserve_route_index_lookup_seconds", "Prefix-index lookups (one Redis round trip), failed ones included.",
            registry=self.registry, buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        )
        self.predicted_hits = Counter(
            "pdserve_route_predicted_hit_tokens", "Prompt tokens the prefix index said the chosen worker holds.",
            ["tier", "replica"], registry=self.registry,
        )
        self.rate_limit_errors = Counter(
            "pdserve_rate_limit_errors", "Rate-limit decisions Redis could not make (the request was let through).",
            labels, registry=self.registry,
        )

    def track(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self, worker_stats: dict[str, dict[str, dict]], silent: dict[str, int], planner: dict | None = None) -> bytes:
        """`planner`: the SLO planner's last status (router/planner_status.py), if any."""
        workers = CollectorRegistry(auto_describe=False)
        workers.register(_WorkerCollector(worker_stats, silent, self.phases.snapshot()))
        if planner:
            workers.register(_PlannerCollector(planner))
        return generate_latest(self.registry) + generate_latest(workers)


class RequestTimer:
    """Observes one generation stream: call `output()` per streamed delta, `finish()` once."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None

    def output(self) -> None:
        now = time.perf_counter()
        replica = self.metrics.replica
        if self.last is None:
            self.metrics.ttft.labels(replica).observe(now - self.start)
        else:
            self.metrics.itl.labels(replica).observe(now - self.last)
        self.last = now

    def finish(self, status: str, finish_reason: str | None) -> None:
        replica = self.metrics.replica
        if status == "ok":
            self.metrics.e2e.labels(replica).observe(time.perf_counter() - self.start)
        self.metrics.requests.labels(replica, status, finish_reason or "none").inc()


class _WorkerCollector:
    """Families built from one scrape's worker stats ({tier: {worker_id: stats}}) and
    the count of running replicas per tier that did not answer in time."""

    def __init__(self, stats: dict[str, dict[str, dict]], silent: dict[str, int], gateway_phases: dict[str, dict]):
        self.stats = stats
        self.silent = silent
        self.gateway_phases = gateway_phases

    def collect(self):
        running = GaugeMetricFamily("pdserve_requests_running", "Requests in the running batch, per tier.", labels=["tier"])
        waiting = GaugeMetricFamily(
            "pdserve_requests_waiting", "Requests waiting to be scheduled or for their KV, per tier.", labels=["tier"]
        )
        usage = GaugeMetricFamily(
            "pdserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (cached idle blocks count as free).",
            labels=["tier", "replica"],
        )
        transfer_bytes = CounterMetricFamily(
            "pdserve_kv_transfer_bytes", "KV bytes received by decode workers from prefill workers."
        )
        transfer_seconds = SummaryMetricFamily(
            "pdserve_kv_transfer_seconds", "Time decode workers spent receiving KV transfers (successful ones)."
        )
        queried = CounterMetricFamily(
            "pdserve_prefix_cache_query_tokens", "Prompt tokens of requests admitted by a worker.", labels=["tier", "replica"]
        )
        hit = CounterMetricFamily(
            "pdserve_prefix_cache_hit_tokens", "Of those, tokens found in the worker's prefix cache.", labels=["tier", "replica"]
        )
        transfer_failures = CounterMetricFamily(
            "pdserve_kv_transfer_failures", "KV transfers that failed (then recomputed or failed per policy).", labels=["tier"]
        )
        steps = HistogramMetricFamily(
            "pdserve_engine_step_seconds", "Engine step durations per tier, by kind: decode-only, prompt-only, mixed.",
            labels=["tier", "kind"],
        )
        phases = HistogramMetricFamily(
            "pdserve_request_phase_seconds",
            "Requests' phases per tier, the spans of their traces (traced or not): gateway admission, tokenize, "
            "route (this gateway replica's); decode reserve, prefill_call, kv_receive, handoff; prefill prefill, kv_send.",
            labels=["tier", "phase"],
        )
        _add_histograms(phases, "gateway", PHASES["gateway"], [self.gateway_phases])
        unheard = GaugeMetricFamily(
            "pdserve_workers_silent",
            "Running replicas that did not answer this scrape's stats call in time "
            "(hung, busy beyond it, or killed and not yet dropped by Serve): "
            "their figures are missing from the families above.",
            labels=["tier"],
        )
        for tier, count in self.silent.items():
            unheard.add_metric([tier], count)
        replicas = GaugeMetricFamily("pdserve_tier_replicas", "Replicas serving each role now (answered or silent).",
                                     labels=["tier"])
        for tier in self.stats.keys() | self.silent.keys():
            replicas.add_metric([tier], len(self.stats.get(tier, {})) + self.silent.get(tier, 0))
        received = seconds = transfers = 0.0
        for tier, workers in self.stats.items():
            running.add_metric([tier], sum(s["running"] for s in workers.values()))
            waiting.add_metric([tier], sum(s["waiting"] + s.get("receiving", 0) for s in workers.values()))
            failed = 0
            for worker_id, s in workers.items():
                usage.add_metric([tier, worker_id], s["kv_usage"])
                queried.add_metric([tier, worker_id], s.get("prefix_query_tokens", 0))
                hit.add_metric([tier, worker_id], s.get("prefix_hit_tokens", 0))
                t = s.get("transport") or {}
                failed += t.get("transfers_failed", 0)
                if tier == "decode":
                    received += t.get("bytes_received", 0)
                    seconds += t.get("seconds_receiving", 0.0)
                    transfers += t.get("transfers_ok", 0)
            transfer_failures.add_metric([tier], failed)
            _add_histograms(steps, tier, KINDS, [s["step_seconds"] for s in workers.values() if "step_seconds" in s])
            _add_histograms(phases, tier, PHASES.get(tier, ()), [s["phase_seconds"] for s in workers.values() if "phase_seconds" in s])
        transfer_bytes.add_metric([], received)
        transfer_seconds.add_metric([], count_value=transfers, sum_value=seconds)
        yield from (running, waiting, usage, queried, hit, transfer_bytes, transfer_seconds, transfer_failures, steps, phases, unheard,
                    replicas)


class _PlannerCollector:
    """The SLO planner's last decision and what it rested on (cluster/planner/policy.py)."""

    def __init__(self, status: dict):
        self.status = status

    def collect(self):
        s = self.status
        target = GaugeMetricFamily("pdserve_planner_replicas", "Replicas the SLO planner sizes each tier to.", labels=["tier"])
        for tier, n in (s.get("replicas") or {}).items():
            target.add_metric([tier], n)
        seconds = GaugeMetricFamily(
            "pdserve_planner_seconds",
            "The SLO planner's mean TTFT and ITL: its target, its prediction for the current split (calibrated), "
            "and what the decode replicas observed.", labels=["slo", "kind"])
        for slo in ("ttft", "itl"):
            for kind, key in (("target", f"slo_{slo}_s"), ("predicted", f"predicted_{slo}_s"), ("observed", f"observed_{slo}_s")):
                if s.get(key) is not None:
                    seconds.add_metric([slo, kind], s[key])
        load = GaugeMetricFamily("pdserve_planner_load", "The load the SLO planner observed and forecast: requests/s, "
                                 "prompt tokens computed per request, output tokens per request.", labels=["kind", "figure"])
        for kind in ("observed", "forecast"):
            for figure, value in (s.get(kind) or {}).items():
                load.add_metric([kind, figure], value)
        state = GaugeMetricFamily("pdserve_planner_state", "1 for the SLO planner's state (learning, steady, confirming, "
                                  "moving) and the split it chose.", labels=["state", "chosen"])
        state.add_metric([s.get("state", "unknown"), s.get("chosen", "")], 1)
        yield from (target, seconds, load, state)


def _add_histograms(family: HistogramMetricFamily, tier: str, labels, snapshots: list[dict]) -> None:
    """One series per label of `tier`: the workers' Histograms snapshots (BUCKETS_S), summed."""
    bounds = [*(str(b) for b in BUCKETS_S), "+Inf"]
    for label in labels:
        hists = [snapshot[label] for snapshot in snapshots if label in snapshot]
        if hists:
            counts = [sum(col) for col in zip(*(h["buckets"] for h in hists))]
            family.add_metric([tier, label], list(zip(bounds, counts)), sum_value=sum(h["sum"] for h in hists))
