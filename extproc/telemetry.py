"""The router's own telemetry: Prometheus metrics on a private registry (several routers can
share a process), structured log lines, and one span per decision exported over OTLP.

Metric names follow Prometheus' conventions (docs/observability.md): base units (``_seconds``,
``_ratio``), ``_total`` on counters, no ``_created`` series, and every per-replica series labelled
``replica`` and ``region``. Per-replica gauges are read from the fleet state arrays at scrape
time, so the hot path only increments counters and observes histograms; a span is queued on the
hot path as a tuple and built and exported in batches by a background task.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import deque
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gorgo.core.contract import ROUTER_SERVICE, ROUTER_SPAN
from gorgo.core.state import FleetState

# No _created series: one more per labelled counter and histogram child, which no dashboard uses.
# Process-wide, read at every scrape.
disable_created_metrics()

DECISION_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)
# A whole request as the router sees it: from its decision to the end of Envoy's ext_proc stream.
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# How late an event loop ran a timer (extproc/signals.py LoopLag).
LAG_BUCKETS = (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
REPLICA_LABELS = ("replica", "region")
# The model label takes the first MAX_MODEL_LABELS model names clients sent, then "other": a
# client-chosen string must not grow the series without bound.
MAX_MODEL_LABELS = 16
MODEL_LABEL_CHARS = 64
# Decision spans: queued at most this many between exports, exported this often, at most
# MAX_BATCH per export.
MAX_QUEUED_SPANS = 8192
EXPORT_INTERVAL_S = 1.0
EXPORT_TIMEOUT_S = 2.0
MAX_BATCH = 2048
# Building a span costs about 30 us (18 attributes): at most this many are built between two
# chances for the loop to run decisions, about 4 ms.
BUILD_CHUNK = 128

log = logging.getLogger("gorgo.telemetry")


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One structured (logfmt) line: ``event=NAME key=value ...``, values with spaces quoted, so
    a log pipeline can parse ejections, re-admissions and weight changes without a regex per
    message."""
    def text(v: Any) -> str:
        v = f"{v:g}" if isinstance(v, float) else str(v)
        if v and not any(c in v for c in ' ="\\\n\r'):
            return v
        # escaped, so a value (a peer's bad message, say) cannot add a field or a line
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
            .replace("\r", "\\r") + '"'
    logger.log(level, " ".join(f"{k}={text(v)}" for k, v in {"event": event, **fields}.items()))


class RepeatedFailures:
    """A retry loop's failures as ``event`` lines: a warning when a failure differs from the
    last one of its ``key`` (a replica, say), debug while it repeats (a loop retrying every
    second would otherwise print one warning a second, or, at debug, none an operator sees)."""

    def __init__(self, logger: logging.Logger, event: str) -> None:
        self.logger = logger
        self.event = event
        self._last: dict[object, str] = {}

    def __call__(self, exc: Exception, key: object = None, **fields: Any) -> None:
        text = f"{type(exc).__name__}: {exc}"[:300]
        level = logging.DEBUG if self._last.get(key) == text else logging.WARNING
        self._last[key] = text
        log_event(self.logger, self.event, level, **fields, error=text)


def _per_replica(value: float | np.ndarray | None, n: int) -> np.ndarray:
    """An estimate that is one value for the fleet, or one per replica, as one per replica."""
    return np.broadcast_to(math.nan if value is None else value, (n,))


class _StateCollector(Collector):
    def __init__(self, state: FleetState, open_requests) -> None:
        self.state = state
        self.open_requests = open_requests

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.state
        gauges = {
            "gorgo_inflight_requests": ("Requests in flight sent by this router", s.inflight_reqs),
            "gorgo_inflight_prompt_tokens": ("Prompt tokens in flight", s.inflight_prompt_tokens),
            "gorgo_rtt_seconds": ("RTT EWMA from health probes", s.rtt_ms / 1000.0),
            "gorgo_engine_queue_requests": ("Scraped engine queue length", s.eng_queue_reqs),
            "gorgo_engine_running_requests": ("Scraped engine running", s.eng_running_reqs),
            "gorgo_engine_kv_usage_ratio": ("Scraped engine KV cache usage (0-1)", s.eng_kv_usage),
            "gorgo_replica_healthy": ("1 if the replica is routable", s.healthy.astype(float)),
            "gorgo_prefill_rate_tokens_per_second": ("Prefill rate used by the cost",
                                                     s.prefill_rate),
            "gorgo_penalty_seconds": ("Anomaly penalty in the cost (decayed)",
                                      s.penalty() / 1000.0),
            "gorgo_output_tokens_typical": (
                "Tokens a finished request of the replica's model generated, from the engines' "
                "counters (NaN: not yet known)", _per_replica(s.outputs.typical(), s.n)),
            "gorgo_max_tokens_typical": (
                "max_tokens of the routed requests of the replica's model that set it, on "
                "average (decayed; NaN: none yet)", _per_replica(s.outputs.typical_bound(), s.n)),
        }
        for name, (doc, values) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=list(REPLICA_LABELS))
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
    """Every series the router exports; ``otlp`` (HOST:PORT) also exports decision spans."""

    def __init__(self, state: FleetState, open_requests, otlp: str | None = None) -> None:
        self.state = state
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._models: set[str] = set()
        # The series the request path writes, by metric and label values (`labelled`).
        self._children: dict[tuple[Counter | Histogram, tuple[str, ...]], Any] = {}
        self.decisions = Counter(
            "gorgo_decisions", "Routing decisions", ["policy", *REPLICA_LABELS, "model"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "gorgo_decision_seconds", "Body received to answer sent", ["policy"],
            buckets=DECISION_BUCKETS, registry=r,
        )
        self.request_seconds = Histogram(
            "gorgo_request_duration_seconds", "Decision to the end of the request (Envoy closes "
            "the ext_proc stream then), by the replica that served it", list(REPLICA_LABELS),
            buckets=REQUEST_BUCKETS, registry=r,
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
            "replica that failed first", list(REPLICA_LABELS), registry=r,
        )
        self.fail_open = Counter(
            "gorgo_fail_open", "Requests passed to the default route after a router error",
            registry=r,
        )
        self.probe_errors = Counter(
            "gorgo_probe_errors", "Failed health/RTT probes", list(REPLICA_LABELS), registry=r
        )
        self.probe_inconclusive = Counter(
            "gorgo_probe_inconclusive", "Probe timeouts not counted against the replica: the "
            "signal loop itself was late", list(REPLICA_LABELS), registry=r,
        )
        self.loop_lag = Histogram(
            "gorgo_loop_lag_seconds", "How late an event loop ran a timer: router (decisions) or "
            "signals (probes, scrapes)", ["loop"], buckets=LAG_BUCKETS, registry=r,
        )
        self.scrape_errors = Counter(
            "gorgo_scrape_errors", "Failed engine metric scrapes", list(REPLICA_LABELS),
            registry=r,
        )
        self.upstream_status = Counter(
            "gorgo_upstream_responses", "Response status classes per replica",
            [*REPLICA_LABELS, "status_class"], registry=r,
        )
        self.spans = DecisionSpans(otlp, Counter(
            "gorgo_trace_spans", "Decision spans by outcome (exported, dropped: queue full, "
            "failed: the export failed)", ["result"], registry=r,
        ))
        self._collector = _StateCollector(state, open_requests)
        r.register(self._collector)
        self.fleet_reloads = Counter(
            "gorgo_fleet_reloads", "Fleet reloads by outcome (applied, unchanged, error: the old "
            "fleet stays; cds_error: the clusters file could not be put in place after the "
            "router took a fleet on, tried again each second)", ["result"], registry=r,
        )

    def rebind(self, state: FleetState, removed: list[str]) -> None:
        """Read the fleet state the router now has; a removed replica's series all go (what a
        dashboard would otherwise show as a replica frozen at its last values)."""
        self.state = self._collector.state = state
        self._children.clear()  # a kept child of a removed series would count unexported
        gone = set(removed)
        for metric in vars(self).values():
            # prometheus_client has no public accessor for a metric's label names.
            names = getattr(metric, "_labelnames", ())
            if not isinstance(metric, Counter | Histogram) or "replica" not in names:
                continue
            for labels in {tuple(x.labels[n] for n in names)
                           for fam in metric.collect() for x in fam.samples
                           if x.labels.get("replica") in gone}:
                metric.remove(*labels)

    def labelled(self, metric: Counter | Histogram, *values: str) -> Any:
        """``metric.labels(*values)``, kept: labels() checks its arguments and takes a lock on
        every call (2-3 us, four times a request on the request path); `rebind` forgets the
        kept ones when it removes series."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def replica(self, i: int) -> tuple[str, str]:
        """The replica and region labels of replica index ``i``."""
        s = self.state
        return s.names[i], s.regions[s.region_idx[i]]

    def model(self, name: str | None) -> str:
        """The model label of a request's model name: bounded (see MAX_MODEL_LABELS)."""
        if not name:
            return "none"
        name = name[:MODEL_LABEL_CHARS]
        if name not in self._models:
            if len(self._models) >= MAX_MODEL_LABELS:
                return "other"
            self._models.add(name)
        return name


def parse_traceparent(value: str | None) -> tuple[bytes, bytes] | None:
    """(trace id, parent span id) of a sampled W3C traceparent, else None."""
    parts = (value or "").split("-")
    if len(parts) < 4 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), int(
            parts[3][:2], 16)
    except ValueError:
        return None
    if not flags & 1 or not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id


_UNSET = Status()  # a routed or refused request: not an error of the router
_ERROR = Status(code=Status.STATUS_CODE_ERROR, message="routing failed; failed open")


def _any(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=str(v))


class DecisionSpans:
    """The router's span per decision: a child of Envoy's span of the ext_proc stream (whose
    context Envoy sends as the stream's ``traceparent`` metadata), lasting the decision alone and
    carrying its outcome and the winning replica's terms, typed. Exported over OTLP/gRPC in
    batches off the request path; a full queue or a failed export drops spans, counted, and
    nothing retries: a trace is not worth a slower router."""

    def __init__(self, target: str | None, counter: Counter,
                 interval_s: float = EXPORT_INTERVAL_S) -> None:
        self.target = target
        self.enabled = target is not None
        self.counter = counter
        self.interval_s = interval_s
        self._queue: deque[tuple[tuple[bytes, bytes], int, int, dict[str, Any], bool]] = deque()
        self._channel: grpc.aio.Channel | None = None
        self._stub: TraceServiceStub | None = None
        self._task: asyncio.Task | None = None
        self._resource = Resource(attributes=[KeyValue(key="service.name",
                                                       value=_any(ROUTER_SERVICE))])

    def record(self, parent: tuple[bytes, bytes], start_ns: int, end_ns: int,
               attrs: dict[str, Any], error: bool = False) -> None:
        if len(self._queue) >= MAX_QUEUED_SPANS:
            self.counter.labels("dropped").inc()
            return
        self._queue.append((parent, start_ns, end_ns, attrs, error))

    async def start(self) -> None:
        if self.enabled:
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub = TraceServiceStub(self._channel)
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._channel is not None:
            await self.flush()
            await self._channel.close()
            self._channel = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        while self._queue and self._stub is not None:
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
            try:
                if not await self._export(batch):
                    return  # the collector failed it: the rest waits for the next interval
            except asyncio.CancelledError:
                # `stop` cancelled the loop mid-export: the batch goes back for stop's own flush
                # (it was lost, counted nowhere; a span the cancelled call delivered may come
                # twice)
                self._queue.extendleft(reversed(batch))
                raise

    async def _export(self, batch: list) -> bool:
        """One batch to the collector; False (counted as failed) when it refused it."""
        assert self._stub is not None
        spans: list[Span] = []
        for lo in range(0, len(batch), BUILD_CHUNK):
            spans += [Span(
                trace_id=trace_id, span_id=os.urandom(8), parent_span_id=parent_id,
                name=ROUTER_SPAN, kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=start,
                end_time_unix_nano=end,
                attributes=[KeyValue(key=k, value=_any(v)) for k, v in attrs.items()],
                status=_ERROR if error else _UNSET,
            ) for (trace_id, parent_id), start, end, attrs, error in batch[lo:lo + BUILD_CHUNK]]
            await asyncio.sleep(0)  # decisions run between chunks, not after the batch
        request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
            resource=self._resource,
            scope_spans=[ScopeSpans(scope=InstrumentationScope(name="gorgo.extproc"),
                                    spans=spans)])])
        try:
            await self._stub.Export(request, timeout=EXPORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.counter.labels("failed").inc(len(spans))
            log.debug("span export to %s failed: %s", self.target, exc.code())
            return False
        self.counter.labels("exported").inc(len(spans))
        return True
