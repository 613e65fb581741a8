"""Builders shared by the tuner tests: OTLP spans shaped like Envoy's."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from gorgo.core.contract import LOG_PERIODIC, LOG_TYPE_ATTR, STATUS_ATTR, TTFT_ATTR

T0_NS = 1_700_000_000 * 10**9


def envoy_attrs(**over: Any) -> dict[str, Any]:
    """Attributes as Envoy's custom tags carry them: every value a string."""
    attrs: dict[str, Any] = {
        TTFT_ATTR: "123456", STATUS_ATTR: "200", "gorgo.decision_id": "ab-1",
        "gorgo.replica": "r0", "gorgo.region": "near", "gorgo.policy": "gorgo",
        "gorgo.weights_version": "3", "gorgo.predicted_ttft_ms": "101.5",
        "gorgo.rtt_ms": "40.25", "gorgo.queue_ms": "10", "gorgo.prefill_ms": "51.25",
        "gorgo.admission_ms": "0", "gorgo.congestion_ms": "3.5",
        "gorgo.penalty_ms": "0", "gorgo.uncached_tokens": "512", "gorgo.prompt_tokens": "1024",
        "upstream_cluster": "r0", "component": "proxy",
    }
    for k, v in over.items():
        key = k.replace("__", ".")
        if v is None:
            attrs.pop(key, None)
        else:
            attrs[key] = v
    return attrs


def _set_attrs(item: Span | LogRecord, attrs: dict[str, Any]) -> None:
    for k, v in attrs.items():
        if isinstance(v, bool):
            value = AnyValue(bool_value=v)
        elif isinstance(v, int):
            value = AnyValue(int_value=v)
        elif isinstance(v, float):
            value = AnyValue(double_value=v)
        else:
            value = AnyValue(string_value=str(v))
        item.attributes.append(KeyValue(key=k, value=value))


def make_span(attrs: dict[str, Any], duration_ms: float = 800.0, start_ns: int = T0_NS) -> Span:
    span = Span(name="ingress", start_time_unix_nano=start_ns,
                end_time_unix_nano=start_ns + int(duration_ms * 1e6))
    _set_attrs(span, attrs)
    return span


def make_record(attrs: dict[str, Any], log_type: str = LOG_PERIODIC,
                start_ns: int = T0_NS) -> LogRecord:
    """An entry of Envoy's TTFT log: the span's attributes plus the entry's type."""
    record = LogRecord(time_unix_nano=start_ns)
    _set_attrs(record, {**attrs, LOG_TYPE_ATTR: log_type})
    return record


def make_log_export(records: list[LogRecord]) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    req.resource_logs.add().scope_logs.add().log_records.extend(records)
    return req


def make_export(spans: list[Span]) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    req.resource_spans.add().scope_spans.add().spans.extend(spans)
    return req


def ipv6_loopback() -> bool:
    """Whether this host can bind ::1 (a container may have no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture
def span_builders() -> tuple[Callable, Callable, Callable]:
    return envoy_attrs, make_span, make_export


class FixedOrder:
    """Stands in for `Tuner.order_rng`: every evaluation's windows in one known order, the
    incumbent's first (I C for one pair, I C C I for two; a block added later, the same), for
    the tests of what happens inside an evaluation. The drawn order has tests of its own."""

    def permutation(self, n: int) -> list[int]:
        pairs = n // 2
        # `window_plan` lays its windows out as pairs candidates, then pairs incumbents
        cand, inc = iter(range(pairs)), iter(range(pairs, n))
        return [next(inc) if first == (k % 2 == 0) else next(cand)
                for k in range(pairs) for first in (True, False)]


def fixed_order(tuner: Any) -> Any:
    """``tuner`` with its windows in the order of `FixedOrder`."""
    tuner.order_rng = FixedOrder()
    return tuner
