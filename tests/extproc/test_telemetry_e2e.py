"""What Jaeger and Prometheus get, end to end: real Envoy exporting spans over OTLP to a test
receiver, the router exporting its decision spans to the same receiver, Envoy's access log, and
the router's health endpoints.

The OpenTelemetry Collector does not run here (no binary can be installed), so the shipped
collector's transform (gorgo.core.otel, the same table as deploy/otel-collector.yaml's statements,
which tests/extproc/test_telemetry.py checks equal) is applied to the captured spans in Python.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from extproc.main import EXTPROC_SERVICE
from gorgo.core.contract import (
    EXTPROC_SPAN,
    GENAI_MODEL_ATTR,
    GENAI_OPERATION_ATTR,
    GENAI_PROVIDER_ATTR,
    GENAI_STREAM_ATTR,
    GENAI_TTFC_ATTR,
    OUTCOME_ATTR,
    ROUTER_SERVICE,
    ROUTER_SPAN,
    TERM_FIELDS,
    TTFT_ATTR,
    UPLOAD_ATTR,
)
from gorgo.core.otel import typed_attributes
from gorgo.harness.procs import wait_for
from tests.support.e2e import Stack, chat, start_stack, stop_stack

pytestmark = pytest.mark.envoy
PROMPT = "a secret prompt that must stay out of every log "


def _value(v) -> object:
    return getattr(v, v.WhichOneof("value"))


def _attrs(span: Span) -> dict[str, object]:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("telemetry")
    st = start_stack(tmp, n=2, router_spans=True, observability={
        "access_log": True, "access_log_path": str(tmp / "access.log")})
    yield st
    stop_stack(st)


def _trace(stack: Stack, stream: bool) -> tuple[str, dict[str, tuple[str, Span]]]:
    """One request; its decision id and its trace's spans by name, once all three arrived."""
    status, headers, _, _ = stack.post(chat(PROMPT * 20, stream=stream))
    assert status == 200
    did = headers["x-gorgo-decision-id"]

    def spans() -> dict[str, tuple[str, Span]]:
        ingress = [s for _, s in stack.sink.raw if _attrs(s).get("gorgo.decision_id") == did]
        if not ingress:
            return {}
        trace = ingress[0].trace_id
        return {s.name: (svc, s) for svc, s in stack.sink.raw if s.trace_id == trace}

    assert wait_for(lambda: len(spans()) == 3, 15), spans()
    return did, spans()


def _ingress(spans: dict[str, tuple[str, Span]]) -> Span:
    """Envoy's span of the request itself."""
    (span,) = [s for name, (_, s) in spans.items() if name not in (EXTPROC_SPAN, ROUTER_SPAN)]
    return span


@pytest.mark.parametrize("stream", [True, False])
def test_genai_attributes_have_the_conventions_names_types_and_units(
        stack: Stack, stream: bool) -> None:
    _, spans = _trace(stack, stream)
    ingress = _ingress(spans)
    raw = _attrs(ingress)
    # What Envoy sends: strings only, the first byte in whole microseconds under a gorgo.* name.
    assert all(isinstance(v, str) for v in raw.values())
    assert raw[TTFT_ATTR].isdigit() and GENAI_TTFC_ATTR not in raw
    typed = typed_attributes(ingress.name, raw)
    assert typed[GENAI_OPERATION_ATTR] == "chat"
    assert typed[GENAI_PROVIDER_ATTR] == "sglang"
    assert typed[GENAI_MODEL_ATTR] == "m"
    assert typed[GENAI_STREAM_ATTR] is stream
    if stream:  # a double, in seconds, inside the request's own span
        ttfc = typed[GENAI_TTFC_ATTR]
        assert isinstance(ttfc, float) and ttfc == int(raw[TTFT_ATTR]) / 1e6
        assert 0 < ttfc < (ingress.end_time_unix_nano - ingress.start_time_unix_nano) / 1e9
    else:  # a whole answer has no first chunk
        assert GENAI_TTFC_ATTR not in typed


def test_every_request_is_traced_whatever_its_clients_sampled_flag(stack: Stack) -> None:
    """A client's `traceparent` saying "not sampled" (OpenTelemetry SDKs with a ratio sampler
    send it on most requests) kept Envoy from exporting the request's span: the tuner never saw
    its E2E (its windows under `e2e` waited for it). The span keeps the client's trace id, and
    says how long the client took to send the request (the tuner takes it off)."""
    trace_id = "5b" * 16
    status, headers, _, _ = stack.post(
        chat(PROMPT, stream=True), {"traceparent": f"00-{trace_id}-{'1c' * 8}-00"})
    assert status == 200
    did = headers["x-gorgo-decision-id"]

    def ingress() -> list[Span]:
        return [s for _, s in stack.sink.raw if _attrs(s).get("gorgo.decision_id") == did]

    assert wait_for(lambda: ingress(), 15)
    (span,) = ingress()
    assert span.trace_id.hex() == trace_id
    assert str(_attrs(span)[UPLOAD_ATTR]).isdigit()


def test_the_router_span_is_the_decision_and_nothing_is_canceled(stack: Stack) -> None:
    _, spans = _trace(stack, True)
    envoy_svc, ext = spans[EXTPROC_SPAN]
    svc, route = spans[ROUTER_SPAN]
    ingress = _ingress(spans)
    assert svc == ROUTER_SERVICE and envoy_svc != ROUTER_SERVICE
    assert route.parent_span_id == ext.span_id and ext.parent_span_id == ingress.span_id
    assert route.kind == Span.SPAN_KIND_INTERNAL and route.status.code == 0  # unset: no error

    def duration(s: Span) -> int:
        return s.end_time_unix_nano - s.start_time_unix_nano

    # The stream lasts the whole request (upstream streams for 400 ms); the decision is a sliver.
    assert ext.start_time_unix_nano <= route.start_time_unix_nano
    assert duration(route) < duration(ext) / 4
    attrs = _attrs(route)
    assert attrs[OUTCOME_ATTR] == "routed"
    assert isinstance(attrs["gorgo.weights_version"], int) and attrs["gorgo.stream"] is True
    for field in ("predicted_ttft_ms", *TERM_FIELDS):
        assert isinstance(attrs[f"gorgo.{field}"], float), field
    assert attrs["gorgo.replica"] == _attrs(ingress)["gorgo.replica"]
    # Envoy tags the stream it closed itself "canceled"; the collector's rewrite drops that.
    assert _attrs(ext).get("status") == "canceled"
    assert "status" not in typed_attributes(ext.name, _attrs(ext))


def test_access_log_has_one_line_per_request_and_no_prompt(stack: Stack) -> None:
    path = stack.fleet_path.parent / "access.log"
    dids = [_trace(stack, stream)[0] for stream in (True, False)]

    def lines() -> dict[str, dict]:
        if not path.exists():
            return {}
        docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {d["decision_id"]: d for d in docs}

    # Envoy flushes file access logs every 10 s (--file-flush-interval-msec's default).
    assert wait_for(lambda: set(dids) <= set(lines()), 30, interval=0.5)
    text = path.read_text()
    assert PROMPT.strip() not in text
    for did in dids:
        line = lines()[did]
        assert line["status"] == 200 and line["replica"] in ("r0", "r1")
        assert str(line["first_byte_us"]).isdigit()
        assert line["path"] == "/v1/chat/completions" and line["model"] == "m"
    assert {lines()[d]["stream"] for d in dids} == {"true", "false"}


def test_router_health_endpoints_and_grpc_health(stack: Stack) -> None:
    port = stack.extproc.field("metrics")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
        doc = json.loads(r.read())
    assert doc == {"ready": True, "checks": {"fleet_loaded": True, "routable_replica": True,
                                             "signal_loop": True}}
    with grpc.insecure_channel(f"127.0.0.1:{stack.extproc.field('grpc')}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", EXTPROC_SERVICE):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
