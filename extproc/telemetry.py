"""The router's own Prometheus metrics, on a private registry (several routers can share a process).

Per-replica gauges are read from the fleet state arrays at scrape time, so the hot path only
increments counters and observes one histogram.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gorgo.core.state import FleetState

DECISION_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)


class _StateCollector(Collector):
    def __init__(self, state: FleetState, open_requests) -> None:
        self.state = state
        self.open_requests = open_requests

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.state
        gauges = {
            "gorgo_inflight_requests": ("Requests in flight sent by this router", s.inflight_reqs),
            "gorgo_inflight_prompt_tokens": ("Prompt tokens in flight", s.inflight_prompt_tokens),
            "gorgo_rtt_ms": ("RTT EWMA from health probes (ms)", s.rtt_ms),
            "gorgo_engine_queue_requests": ("Scraped engine queue length", s.eng_queue_reqs),
            "gorgo_engine_running_requests": ("Scraped engine running", s.eng_running_reqs),
            "gorgo_engine_kv_usage": ("Scraped engine KV cache usage (0-1)", s.eng_kv_usage),
            "gorgo_replica_healthy": ("1 if the replica is routable", s.healthy.astype(float)),
            "gorgo_prefill_rate_tokens_per_s": ("Prefill rate used by the cost", s.prefill_rate),
            "gorgo_penalty_ms": ("Anomaly penalty in the cost (ms, decayed)", s.penalty()),
        }
        for name, (doc, values) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["replica", "region"])
            for i, replica in enumerate(s.names):
                g.add_metric([replica, s.regions[s.region_idx[i]]], float(values[i]))
            yield g
        w = GaugeMetricFamily("gorgo_weights", "Active cost weights", labels=["term"])
        for term, value in s.weights.items():
            w.add_metric([term], value)
        yield w
        v = GaugeMetricFamily("gorgo_weights_version", "Active weights version")
        v.add_metric([], s.weights.version)
        yield v
        o = GaugeMetricFamily("gorgo_open_decisions", "Decisions whose stream has not closed")
        o.add_metric([], self.open_requests())
        yield o


class RouterMetrics:
    def __init__(self, state: FleetState, open_requests) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter(
            "gorgo_decisions", "Routing decisions", ["policy", "replica"], registry=r
        )
        self.decision_seconds = Histogram(
            "gorgo_decision_seconds", "Body received to answer sent", buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "gorgo_rejected_requests", "Requests answered by the router itself", ["status"],
            registry=r,
        )
        self.shed = Counter(
            "gorgo_shed_requests", "Requests shed by admission control (429)", ["priority"],
            registry=r,
        )
        self.retried = Counter(
            "gorgo_retried_requests", "Requests Envoy retried on the next-best replica, by the "
            "replica that failed first", ["replica"], registry=r,
        )
        self.fail_open = Counter(
            "gorgo_fail_open", "Requests passed to the default route after a router error",
            registry=r,
        )
        self.probe_errors = Counter(
            "gorgo_probe_errors", "Failed health/RTT probes", ["replica"], registry=r
        )
        self.scrape_errors = Counter(
            "gorgo_scrape_errors", "Failed engine metric scrapes", ["replica"], registry=r
        )
        self.upstream_status = Counter(
            "gorgo_upstream_responses", "Response status classes per replica",
            ["replica", "status_class"], registry=r,
        )
        r.register(_StateCollector(state, open_requests))
